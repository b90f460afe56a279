"""Lossless acceptance of a draft tree against the target's distributions.

Vocabulary (per verify cycle):

- **root**: node 0 of the tree, the last committed token. The target's
  distribution at node u, `probs[u]`, is over the token that follows the
  root-to-u path.
- **accepted tokens**: the draft nodes on the path the target agrees with,
  walking down from the root. Indices exclude the root; may be empty.
- **residual**: the target distribution at the last accepted node with the
  tokens of every rejected child removed (and renormalised).
- **bonus token**: one token drawn from the residual (or the target's argmax
  under greedy decoding). It is always committed, so each cycle commits
  `len(accepted) + 1` tokens; the bonus becomes the next cycle's root.

Sampling uses multi-draft recursive rejection with deterministic (one-hot)
proposals, as in SpecInfer (Miao et al., 2023, arXiv:2305.09781, "multi-step
speculative sampling") and the EAGLE / EAGLE-2 reference (Li et al., 2024,
arXiv:2401.15077, arXiv:2406.16858). With a one-hot proposal q = e_x the
speculative-sampling rule min(1, p(x)/q(x)) becomes "accept x with
probability p(x)", and the residual norm(max(0, p - q)) becomes "p with x
zeroed, renormalised". Trying siblings one after another on successive
residuals makes the committed tokens distributed exactly as sampling from
the target step by step, whatever tokens the drafter proposed.

A node whose children were drawn from the draft distribution (sampled
proposals, ``tree.proposals``; see specdec.tree.proposals) is accepted with that
distribution as q: min(1, p(x)/q(x)) per child, residual norm(max(0, p - q)),
q losing each drawn token in turn. Both rules are exact, node by node, so a
tree may mix them.

Greedy decoding (temperature 0) is the special case of one-hot target
distributions; `accept_greedy` implements it directly on argmaxes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.request.params import SamplingParams
from specdec.tree.placed import MAX_WIDTH, PARENTS, PATH, STEP, TOKENS, PlacedTree, place_tree
from specdec.tree.sampling import TokenCounts, moved_to, greedy_tokens, sample, target_probs


class TreeLike(Protocol):
    tokens: torch.Tensor  # [n] int64, tokens[0] is the root
    parents: torch.Tensor  # [n] int64, -1 at the root, parents[i] < i
    token_list: list[int]  # the same, on the host
    parent_list: list[int]
    proposals: dict | None  # node -> Proposal its children were drawn from (optional attribute)


@dataclass(frozen=True)
class Acceptance:
    accepted: list[int]  # accepted node indices, root excluded, in path order
    bonus: int  # token drawn at the last accepted node (or the root)

    @property
    def last_node(self) -> int:
        """Tree node whose target distribution produced the bonus token."""
        return self.accepted[-1] if self.accepted else 0

    def tokens(self, tree: TreeLike) -> list[int]:
        """Tokens committed this cycle: accepted draft tokens, then the bonus."""
        tree_tokens = tree.token_list
        return [tree_tokens[i] for i in self.accepted] + [self.bonus]


def _children(parents: list[int]) -> list[list[int]]:
    # Children in index order, i.e. draft-rank order within a depth.
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(node)
    return children


def _check_shapes(tree: TreeLike, per_node: torch.Tensor, what: str) -> int:
    n = tree.tokens.shape[0]
    if tree.parents.shape[0] != n or per_node.shape[0] != n:
        raise ValueError(
            f"{what} has {per_node.shape[0]} rows, tree has {n} tokens and "
            f"{tree.parents.shape[0]} parents"
        )
    return n


def accept_greedy(tree: TreeLike, target_argmax: torch.Tensor) -> Acceptance:
    """Walk from the root, at each node taking the first child whose token is
    the target's argmax there; the bonus is the argmax at the last node.

    target_argmax: [n] int64, the target's argmax at every tree node.
    """
    _check_shapes(tree, target_argmax, "target_argmax")
    return walk_greedy(tree, target_argmax.tolist())        # the cycle's one read


def walk_greedy(tree: TreeLike, best: list[int]) -> Acceptance:
    """``accept_greedy`` over the argmaxes [n] read already."""
    tokens = tree.token_list
    children = _children(tree.parent_list)
    accepted: list[int] = []
    node = 0
    while True:
        nxt = next((c for c in children[node] if tokens[c] == best[node]), None)
        if nxt is None:
            return Acceptance(accepted=accepted, bonus=int(best[node]))
        accepted.append(nxt)
        node = nxt


def greedy_order(placed: PlacedTree, target_argmax: torch.Tensor) -> torch.Tensor:
    """``accept_greedy``'s walk as tensor operations on the device, for the
    work that follows it there before the host has read anything (the KV
    cache's compaction, the features' gather): [n] node indices, the root and
    the accepted nodes first, in path order (the others after them).

    target_argmax: [n] int64 on the device, as for ``accept_greedy``. Node k
    *steps* when its token is the argmax at its parent, unless an earlier
    sibling carries the same token (that one matches too, and the walk takes
    the first matching child: ``placed.STEP`` leaves such twins out); a node
    is on the path when every node of its path below the root steps. As bit
    sets (``specdec.tree.placed``): six operators, whatever the tree's depth."""
    return greedy_walk(placed, target_argmax)[0]


def greedy_walk(placed: PlacedTree, target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``greedy_order`` and [n] bool: which nodes are on the path (the root is)."""
    match = target_argmax[placed.row(PARENTS)] == placed.row(TOKENS)     # [n] bool (the root's unused)
    return _path_first(placed, match)


def _path_first(placed: PlacedTree, match: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The walk's path from the nodes whose test passed (``match`` [n] bool):
    a node steps where it passes and is its parent's first child to
    (``placed.STEP``), and is on the path where every node of its path below
    the root steps -> ([n] node indices, the path's first in path order;
    [n] bool, on the path). Bit sets: four operators whatever the depth."""
    steps = (match * placed.row(STEP)).sum()                              # bit k set where node k steps
    path = placed.row(PATH)
    on_path = (path & steps) == path                                      # [n] bool; the root's path is empty
    return on_path.sort(descending=True, stable=True).indices, on_path


def accept_sampling(tree: TreeLike, probs: torch.Tensor, generator: torch.Generator) -> Acceptance:
    """Multi-draft recursive rejection sampling with one-hot proposals, or the
    node's drawn proposal where the tree has one (``_accept_drawn``).

    probs: [n, V] target distributions at every tree node (rows need not be
    normalised; they are treated as p / p.sum()).

    At node u, children are tried in index order with one uniform draw each:
    child c (token x) is accepted with probability p[x] / sum(p), where p is
    the current residual; on rejection p[x] is zeroed. If every child is
    rejected (or u is a leaf) the bonus is drawn from the residual. A second
    sibling carrying an already rejected token therefore has p[x] = 0 and is
    rejected with certainty. A tree of one-hot proposals (up to
    ``MAX_WIDTH`` nodes), drawn proposals or not, is walked on its device,
    every node at once, one uniform per node drawn up front (``sampled_order``:
    the cycle's one read); a wider one node by node here, one uniform per
    child tried. Only `generator` supplies randomness, so a
    seed reproduces the result.
    """
    n = _check_shapes(tree, probs, "probs")
    proposals = getattr(tree, "proposals", None) or {}
    if 1 < n <= MAX_WIDTH:                                     # every node at once, on the device
        table = proposal_table(tree, probs.device) if proposals else None
        order, tail = sampled_order(place_tree(tree, 0, n, probs.device), probs, generator, table)
        return read_order(order, tail)
    tokens = tree.token_list
    parents = tree.parent_list
    children = _children(parents)

    # p(token of node i | parent of i) for every non-root node in one gather,
    # so the walk touches the vocabulary only for the row sums and the bonus.
    edge_p = [0.0] * n
    if n > 1:
        rows, cols = tree.parents[1:].to(probs.device), tree.tokens[1:].to(probs.device)
        edge_p[1:] = probs[rows, cols].tolist()

    accepted: list[int] = []
    node = 0
    while True:
        row = probs[node]
        if node in proposals and children[node]:
            pick, bonus = _accept_drawn(row, [tokens[c] for c in children[node]], proposals[node], generator)
            if pick is None:
                return Acceptance(accepted=accepted, bonus=bonus)
            node = children[node][pick]
            accepted.append(node)
            continue
        if not children[node]:                            # a leaf: the bonus from its row
            return Acceptance(accepted=accepted, bonus=_draw_residual(row, set(), generator))
        remaining = float(row.sum(dtype=torch.float64))  # residual mass, unnormalised
        rejected: set[int] = set()
        nxt = None
        for child in children[node]:
            tok = tokens[child]
            p_x = 0.0 if tok in rejected else edge_p[child]
            u = float(torch.rand((), generator=generator, device=generator.device))
            # u < p_x / remaining, without dividing; remaining <= p_x (rounding
            # on a residual with no other mass) then accepts with certainty.
            if p_x > 0.0 and u * remaining < p_x:
                nxt = child
                break
            rejected.add(tok)
            remaining -= p_x
        if nxt is None:
            return Acceptance(accepted=accepted, bonus=_draw_residual(row, rejected, generator))
        accepted.append(nxt)
        node = nxt


def sampled_order(placed: PlacedTree, probs: torch.Tensor, generator: torch.Generator,
                  table: ProposalTable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``accept_sampling``'s walk over one-hot proposals as tensor operations
    on the device, every node tried at once: ([n] node indices as
    ``greedy_order`` gives them, the root and the accepted nodes first in path
    order; [2]: how many of them, root included, and the bonus token).

    The walk tries a node's children in index order, child c (token x) on the
    residual its earlier siblings left: accepted with probability p(x) / R_c,
    R_c the parent's row mass less the mass of the earlier siblings' tokens (a
    sibling repeating an earlier one's token has p(x) = 0 there and is
    rejected: ``placed.STEP`` is 0 for it). Whether c would be accepted when
    tried depends only on its own uniform and on R_c, not on the walk, so the
    test runs for every node at once, one uniform each (a node the walk never
    tries leaves its uniform unused: the walk's draws are independent all the
    same). c *steps* when its test passes and no earlier sibling's does (the
    walk took that one first); a node is on the path when every node of its
    path below the root steps. The bonus is drawn from the last path node's
    row with its children's tokens zeroed (all tried and rejected), or the row
    itself where rounding left that residual no mass.

    With ``table``, the nodes it names drew their children from their
    proposals (``_accept_drawn``'s rule): child i of such a node is tried on
    the residual p_i and the proposal q_i its i - 1 earlier siblings' rejection
    left, which depend on those siblings alone, so every child's test again
    runs at once: ``drawn_edges`` runs the recursion for every such node
    together, ``table.most`` rounds. The bonus at such a node is drawn from
    its last residual."""
    n, device = placed.n, probs.device
    index = torch.arange(n, device=device)
    parents, tokens = placed.row(PARENTS), placed.row(TOKENS)
    uniforms = moved_to(torch.rand(n, generator=generator, device=generator.device), device).double()
    mass = probs.sum(-1, dtype=torch.float64)                                     # [n] row masses
    edge = probs[parents, tokens].double() * (placed.row(STEP) != 0)              # p(x) at the parent
    earlier = ((parents[:, None] == parents[None, :]) & (index[None, :] < index[:, None])
               & (index[:, None] > 0) & (index[None, :] > 0))                      # [n, n]: c's earlier siblings
    left = mass[parents] - earlier.double() @ edge                                # R_c
    passes = (edge > 0) & (uniforms * left < edge)
    if table is not None:
        drawn, p_edge, q_edge, last_residual = drawn_edges(placed, probs, table, earlier)
        passes = torch.where(drawn, (q_edge > 0) & (uniforms * q_edge < p_edge), passes)
    steps = passes & ~(earlier & passes[None, :]).any(-1)                         # the first to pass
    order, on_path = _path_first(placed, steps)
    kept = on_path.sum()
    last = order.gather(0, (kept - 1).view(1))                                    # [1]
    children = (parents == last) & (index > 0)
    if table is not None:                 # a node the walk never takes (a dead draw) rejected nothing
        children = children & (placed.row(STEP) != 0)
    children = children.to(probs.dtype)
    rejected = torch.zeros(probs.shape[-1], dtype=probs.dtype, device=device).index_add_(0, tokens, children) > 0
    row = probs.index_select(0, last)[0]
    residual = _residual(row, rejected)
    residual = torch.where(residual.sum() > 0, residual, row)
    if table is not None:                 # the last node drew its children: its last residual
        at = last_residual.shape[0] - 1
        slot = torch.full((n + 1,), at, dtype=torch.long, device=device).index_copy_(
            0, table.nodes, torch.arange(at, device=device)).index_select(0, last)
        residual = torch.where(slot < at, last_residual.index_select(0, slot)[0], residual.double())
    bonus = moved_to(torch.multinomial(moved_to(residual, generator.device), 1, generator=generator), device)
    return order, torch.cat([kept.view(1), bonus])


@dataclass(frozen=True)
class ProposalTable:
    """A tree's drawn proposals on the device, for ``sampled_order``: ``nodes``
    [m] int64 the nodes that drew their children (n: a row of no node), ``tokens`` [m, s] int64 and
    ``probs`` [m, s] their proposals (zero probs pad a shorter one), and
    ``most`` the most children any of them has."""

    nodes: torch.Tensor
    tokens: torch.Tensor
    probs: torch.Tensor
    most: int


def proposal_table(tree: TreeLike, device) -> ProposalTable:
    """``tree.proposals`` (host ``Proposal``s, as the wire brings them) as a
    ``ProposalTable`` on ``device``: one copy up."""
    proposals = tree.proposals
    nodes = sorted(proposals)
    width = max(proposals[k].tokens.shape[0] for k in nodes)
    host = torch.zeros(len(nodes), 1 + 2 * width, dtype=torch.float64)      # node, tokens, probs (ids < 2**53)
    for row, k in enumerate(nodes):
        m = proposals[k].tokens.shape[0]
        host[row, 0] = k
        host[row, 1:1 + m] = proposals[k].tokens
        host[row, 1 + width:1 + width + m] = proposals[k].probs
    children = [0] * len(tree.parent_list)
    for p in tree.parent_list[1:]:
        children[p] += 1
    up = host.to(device)                                                       # the one copy up
    return ProposalTable(up[:, 0].long(), up[:, 1:1 + width].long(), up[:, 1 + width:],
                         max(children[k] for k in nodes))


def drawn_edges(placed: PlacedTree, probs: torch.Tensor, table: ProposalTable, earlier: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_accept_drawn``'s recursion for every node of ``table`` at once, on the
    device: for each tree node [n], whether its parent drew it (bool), and
    p_i(x), q_i(x) of its test (fp64: the residual and the proposal its
    earlier siblings' rejection left, at its token x); and each table node's
    residual after all its children were rejected, [m + 1, V] fp64 (the last
    row a pad). ``earlier`` [n, n]: ``sampled_order``'s earlier-sibling matrix."""
    n, device, m = placed.n, probs.device, table.nodes.shape[0]
    parents, tokens = placed.row(PARENTS), placed.row(TOKENS)
    index = torch.arange(n, device=device)
    row_of = torch.full((n + 1,), m, dtype=torch.long, device=device).index_copy_(
        0, table.nodes, torch.arange(m, device=device))[:n]                   # node -> table row (m: none)
    drawn = (index > 0) & (row_of[parents] < m) & (placed.row(STEP) != 0)     # (a node never taken: not drawn)
    rank = earlier.sum(-1)                                                     # earlier siblings
    most = max(table.most, 1)
    # child_at[r, i]: the tree node that is row r's i-th child (n: none), through a spare last slot
    where = torch.where(drawn, row_of[parents] * most + rank.clamp(max=most - 1), m * most)
    child_at = torch.full((m * most + 1,), n, dtype=torch.long, device=device).scatter_(
        0, where, torch.where(drawn, index, n))[:-1].view(m, most)
    p = probs.index_select(0, table.nodes.clamp(max=n - 1)).double()      # (a table row of no node: any)
    p = p / p.sum(-1, keepdim=True)
    q = torch.zeros_like(p).scatter_add_(-1, table.tokens, table.probs.double())   # (pads add 0)
    q = q / q.sum(-1, keepdim=True)
    spare_tokens = torch.cat([tokens, tokens.new_zeros(1)])
    p_edge = torch.zeros(n + 1, dtype=torch.float64, device=device)
    q_edge = torch.zeros(n + 1, dtype=torch.float64, device=device)
    for i in range(most):
        child = child_at[:, i]                                                 # [m]
        x = spare_tokens[child]
        p_edge.index_copy_(0, child, p.gather(-1, x[:, None])[:, 0])          # (rows with no i-th child: the spare)
        q_edge.index_copy_(0, child, q.gather(-1, x[:, None])[:, 0])
        has = (child < n)[:, None]
        p, q = torch.where(has, _drawn_residual(p, q), p), torch.where(has, _without(q, x), q)
    return drawn, p_edge[:n], q_edge[:n], torch.cat([p, p.new_zeros(1, p.shape[-1])])


def _residual(row: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """The target's row at the last path node with its rejected tokens zeroed
    (multinomial renormalises: that is the whole residual)."""
    return row.masked_fill(rejected, 0.0)


def read_order(order: torch.Tensor, tail: torch.Tensor) -> Acceptance:
    """The acceptance ``sampled_order`` found, in the cycle's one read."""
    return order_acceptance(torch.cat([order, tail]).tolist())


def order_acceptance(values: list) -> Acceptance:
    """``read_order`` over ``sampled_order``'s outputs read already (the order, then its tail)."""
    kept, bonus = int(values[-2]), int(values[-1])
    return Acceptance(accepted=[int(v) for v in values[1:kept]], bonus=bonus)


def _accept_drawn(row: torch.Tensor, drawn: list[int], proposal, generator: torch.Generator
                  ) -> tuple[int | None, int]:
    """Recursive rejection over children drawn without replacement from
    ``proposal`` (tokens [m], probs [m]), in draw order -> (index of the accepted
    child, -1) or (None, bonus token drawn from the final residual).

    row: [V] target distribution (unnormalised). Work is fp64 over the
    vocabulary: p and q as dense vectors, one uniform per child tried."""
    p = row.to(torch.float64)
    p = p / p.sum()
    q = torch.zeros_like(p)
    q[proposal.tokens.to(p.device)] = proposal.probs.to(p.device, torch.float64)
    q = q / q.sum()
    for i, x in enumerate(drawn):
        q_x, p_x = float(q[x]), float(p[x])
        u = float(torch.rand((), generator=generator, device=generator.device))
        if q_x > 0.0 and u * q_x < p_x:        # probability min(1, p(x) / q(x))
            return i, -1
        p = _drawn_residual(p, q)
        q = _without(q, torch.tensor(x))
    return None, sample(p, generator)


def _without(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The next draw's distribution: q [..., V] with x [...] drawn, renormalised
    (left as it is where nothing else is left)."""
    q = q.scatter(-1, x[..., None], 0.0)
    total = q.sum(-1, keepdim=True)
    return torch.where(total > 0.0, q / total, q)


def _drawn_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) for p, q [..., V] normalised; p itself where that is
    empty (p <= q everywhere means p == q, where a rejection is only rounding)."""
    residual = (p - q).clamp_(min=0.0)
    total = residual.sum(-1, keepdim=True)
    return torch.where(total > 0.0, residual / total, p)


def _draw_residual(row: torch.Tensor, rejected: set[int], generator: torch.Generator) -> int:
    # row: [V]. multinomial renormalises, so zeroing the rejected tokens is the
    # whole residual computation.
    if not rejected:
        return sample(row, generator)
    residual = row.to(generator.device, copy=True)
    residual[list(rejected)] = 0.0
    if not bool(residual.sum() > 0):
        # Only reachable through rounding: the rejected tokens held all the
        # mass, yet rounding in `remaining` rejected the last of them.
        residual = row.to(generator.device)
    return sample(residual, generator)


def accept(
    tree: TreeLike,
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    counts: TokenCounts | None = None,
    allowed: torch.Tensor | None = None,
) -> Acceptance:
    """Acceptance from raw target logits [n, V] under `params`.

    ``counts`` [n, V]: each node's own penalty counts (committed tokens plus
    its path, ``specdec.tree.sampling.History.node_counts``), needed when a penalty
    is on. ``allowed`` [n, V] bool: each node's grammar mask along its own path
    (a constrained session, ``specdec.tree.grammar.GrammarState.node_masks``).
    Greedy params use the argmaxes of the biased, penalised logits and need no
    generator; otherwise the logits are processed by `target_probs` and
    accepted by rejection sampling, in fp32 (fp64 for sampled proposals).
    """
    params.validate()
    if params.greedy:
        return accept_greedy(tree, greedy_tokens(logits, params, counts, allowed))
    if generator is None:
        raise ValueError("generator is required when temperature > 0")
    return accept_sampling(tree, target_probs(logits, params, counts, allowed), generator)
