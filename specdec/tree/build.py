"""Draft trees for speculative decoding: EAGLE-2 dynamic trees and their baselines.

Reference: Li et al., "EAGLE-2: Faster Inference of Language Models with Dynamic
Draft Trees" (2024), §4 and Figure 7, https://arxiv.org/abs/2406.16858.

Vocabulary:
- root: node 0, the last committed token (the previous cycle's bonus token). The
  verifier has not computed its KV yet, so it is verified along with the draft.
- depth (level): distance from the root; the root is at depth 0.
- value: log of the product of draft confidences on the root->node path, kept as
  an fp32 sum of log-probs. EAGLE-2 uses it to estimate that a node is accepted.
- expand: one draft-model call over a frontier (the nodes being extended),
  returning next-token log-probs for each of them.
- pool: every child created while expanding (the candidates). Pool ids number
  the nodes in creation order, 0 being the root.
- rerank: keep the total_tokens - 1 candidates of highest value.

Layout (also the wire format): tokens[n] and parents[n] with parents[0] == -1 and
0 <= parents[i] < i for i >= 1; nodes sorted by (depth, creation index).

Methods (the paper's Table 3 ablations are the project's baselines):
- "eagle2": expand the expand_k nodes of highest value per level, then rerank.
- "no-value": expand the nodes of highest local draft confidence, then rerank.
- "no-rerank": the draft is the expanded frontiers themselves, level by level.
- "chain": one path of greedy draft tokens (classic speculative sampling).
- "static": a fixed shape of rank paths (EAGLE-1 / Medusa style trees).

With a ``ProposalSampler`` (sessions at temperature > 0, see specdec.tree.proposals)
children are drawn from the draft distribution instead of taken best first,
and the tree records each expanded node's proposal. Nothing drawn is dropped
afterwards, so the sampled builder spends the budget as it drafts: each level
gets a number of draws fixed by prior acceptance rates (``sampled_level_budget``;
1 for "chain"), shared among that level's parents by the worth of one more
draw there (the parent's path value plus the draw's prior), and no rerank;
"static" draws as many children as the shape gives each node.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.request.params import TreeParams
from specdec.request.tree_shapes import default_static_shape
from specdec.tree.layout import DraftTree, TreeError, best_positions, subtree, tree_from_lists, validate_tree
from specdec.tree.proposals import Proposal, ProposalSampler

# The layout (DraftTree, its checks, tree_from_lists, subtree) lives in
# specdec.tree.layout; it is re-exported here, where builders and callers meet.
__all__ = ["DraftTree", "ExpandFn", "Frontier", "TreeError", "build_tree", "build_tree_ids",
           "sampled_level_budget", "subtree", "tree_from_lists", "validate_tree"]

# Rounding in a renormalised distribution can put a log-prob a hair above 0; such
# values count as 0. Anything larger is taken to be logits passed by mistake.
LOGP_SLACK = 1e-3


@dataclass(frozen=True)
class Frontier:
    """What the builder asks the draft model to expand (CPU tensors)."""

    nodes: torch.Tensor  # [f] int64 pool ids
    tokens: torch.Tensor  # [f] int64 token at each node
    parents: torch.Tensor  # [f] int64 pool id of each node's parent (-1 for the root)
    depth: int  # depth of these nodes (0 for the root-only first call)


# -> log-probs [f, V] over the next token of each frontier node
ExpandFn = Callable[[Frontier], torch.Tensor]


EXP_FLOOR = -80.0       # a term of a log-sum-exp this far below its row's best counts as this far


def logsumexp(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``torch.logsumexp(x, dim, keepdim=True)``, each term more than
    ``EXP_FLOOR`` below its row's maximum taken at ``EXP_FLOOR`` (adding under
    1e-30 to a sum of at least 1: the same float32 result). The CPU's vectorized
    exp leaves its fast path where a result underflows: an exp of -inf costs ~4x
    a finite one, of a value below ~-88 10-30x, and a reduced draft vocabulary
    (EAGLE-3: every other token -inf) or a low value temperature hits it on most
    of a row. An all -inf row stays -inf, a NaN or +inf best stays as it is."""
    best = x.amax(dim, keepdim=True)
    finite = torch.isfinite(best)
    shifted = (x - torch.where(finite, best, torch.zeros_like(best))).clamp(min=EXP_FLOOR)
    return torch.where(finite, best + torch.log(torch.exp(shifted).sum(dim, keepdim=True)), best)


def _top_tokens(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely next tokens of each row, best first; ties go to the lower id.

    logp: [f, V] -> (log-probs [f, k'] fp32, tokens [f, k'] int64) on CPU, k' = min(k, V).
    """
    k = min(k, logp.shape[-1])
    lp, tok = torch.topk(logp, k, dim=-1)  # [f, k]
    kth = lp[:, -1:]  # [f, 1]
    # the level's one read: are the rows log-probs (NaNs and positives rank first, so the top
    # entries tell), is the k-th place untied, are the top k strictly decreasing
    ordered = (lp[:, :-1] > lp[:, 1:]).all() if k > 1 else torch.ones((), dtype=torch.bool, device=lp.device)
    logprobs, untied, strict = torch.stack([(lp[:, 0] <= LOGP_SLACK).all(), ((logp >= kth).sum(-1) == k).all(),
                                            ordered]).tolist()
    if not logprobs:
        if torch.isnan(lp).any():
            raise ValueError("expand() returned NaN log-probs")
        raise ValueError(f"expand() must return log-probabilities (<= 0), got {lp.max().item():.4g}")
    if not untied:
        # a tie straddles the k-th place and topk may keep any of the tied tokens:
        # keep everything above the k-th value, then the lowest ids among the ties
        above, tied = logp > kth, logp == kth  # [f, V]
        room = k - above.sum(-1, keepdim=True)  # [f, 1]
        take = above | (tied & (tied.cumsum(-1) <= room))  # [f, V], k per row
        tok = take.nonzero()[:, 1].view(-1, k)  # [f, k]
        lp = logp.gather(-1, tok)
    if k > 1 and (not untied or not strict):     # (the tie fix above may reorder: check again)
        # best first, equal log-probs by token id: two stable sorts (without ties
        # topk's descending order is that order already)
        tok, order = tok.sort(dim=-1, stable=True)
        lp, order = lp.gather(-1, order).sort(dim=-1, descending=True, stable=True)
        tok = tok.gather(-1, order)
    return lp.float().clamp(max=0.0).cpu(), tok.cpu()


class _Pool:
    """Every node created while drafting, in creation order (pool id = position)."""

    def __init__(self, root_token: int, expand: ExpandFn, value_temperature: float = 1.0):
        self.expand = expand
        self.proposals: dict[int, Proposal] = {}  # pool id -> proposal of its children
        self.value_temperature = float(value_temperature)
        self.vocab: int | None = None
        self.tokens = torch.tensor([root_token], dtype=torch.int64)  # [P]
        self.parents = torch.tensor([-1], dtype=torch.int64)  # [P]
        self.depths = torch.zeros(1, dtype=torch.int64)  # [P]
        self.values = torch.zeros(1, dtype=torch.float32)  # [P] path log-value
        self.logp = torch.zeros(1, dtype=torch.float32)  # [P] log-prob given the parent

    def __len__(self) -> int:
        return len(self.tokens)

    def next_logp(self, ids: torch.Tensor) -> torch.Tensor:
        """Expand the nodes ids [f] in one call -> checked next-token log-probs [f, V]."""
        frontier = Frontier(ids, self.tokens[ids], self.parents[ids], int(self.depths[ids[0]]))
        logp = self.expand(frontier)
        f = len(ids)
        if not isinstance(logp, torch.Tensor) or logp.dim() != 2 or logp.shape[0] != f:
            got = tuple(logp.shape) if isinstance(logp, torch.Tensor) else type(logp).__name__
            raise ValueError(f"expand() must return log-probs of shape [{f}, V], got {got}")
        if self.vocab is None:
            self.vocab = logp.shape[1]
        if logp.shape[1] != self.vocab or self.vocab == 0:
            raise ValueError(f"expand() returned vocab {logp.shape[1]}, expected {self.vocab} (> 0)")
        return logp

    def top_children(self, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expand the nodes ids [f] in one call -> their top-k (log-probs, tokens), [f, k']."""
        logp = self.next_logp(ids)
        lp, tok = _top_tokens(logp, k)
        t = self.value_temperature
        if t != 1.0:
            # log softmax(logits / t) at the same tokens (order unchanged); an all -inf row stays -inf, not NaN
            lse = logsumexp(logp.float() / t).cpu()  # [f, 1]
            lp = torch.where(torch.isfinite(lse), (lp / t - lse).clamp(max=0.0), lp)
        return lp, tok

    def add(self, parents: torch.Tensor, tokens: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        """Append nodes (parents, tokens, logp all [m]) and return their pool ids [m]."""
        ids = torch.arange(len(self), len(self) + len(parents))
        self.tokens = torch.cat([self.tokens, tokens])
        self.parents = torch.cat([self.parents, parents])
        self.depths = torch.cat([self.depths, self.depths[parents] + 1])
        self.values = torch.cat([self.values, self.values[parents] + logp])  # fp32 sums
        self.logp = torch.cat([self.logp, logp])
        return ids

    def add_children(self, ids: torch.Tensor, k: int) -> torch.Tensor:
        """Give each node in ids [f] its top-k children -> their pool ids [f * k']:
        node 0's children first, best first, then node 1's, ..."""
        lp, tok = self.top_children(ids, k)  # [f, k']
        return self.add(ids.repeat_interleave(tok.shape[1]), tok.flatten(), lp.flatten())

    def tree(self, keep: torch.Tensor) -> DraftTree:
        """The root plus the pool ids in keep [m] (ascending, parents included)."""
        ids = torch.cat([torch.zeros(1, dtype=torch.int64), keep])  # [n]
        where = torch.full((len(self),), -1, dtype=torch.int64)  # pool id -> tree index
        where[ids] = torch.arange(len(ids))
        parents = where[self.parents[ids].clamp(min=0)]
        parents[0] = -1
        # a parent missing from keep maps to -1 and DraftTree's validation rejects it
        proposals = {int(where[k]): prop for k, prop in self.proposals.items()} or None
        return DraftTree(self.tokens[ids], parents, self.depths[ids], self.values[ids], proposals)


def build_tree(root_token: int, expand: ExpandFn, cfg: TreeParams,
               sampler: ProposalSampler | None = None) -> DraftTree:
    """Draft a tree under the root token by calling expand() once per level;
    with ``sampler``, children are drawn (sampled proposals)."""
    return build_tree_ids(root_token, expand, cfg, sampler)[0]


def build_tree_ids(root_token: int, expand: ExpandFn, cfg: TreeParams,
                   sampler: ProposalSampler | None = None) -> tuple[DraftTree, torch.Tensor]:
    """``build_tree`` and the pool id of each tree node ([n] int64, 0 for the root):
    the ids the frontiers passed to expand() used for those nodes."""
    if isinstance(root_token, bool) or operator.index(root_token) < 0:
        raise TreeError(f"root_token must be a token id >= 0, got {root_token!r}")
    if sampler is not None:
        return _build_sampled(root_token, expand, cfg, sampler)
    if cfg.method == "static":
        return _build_static(root_token, expand, cfg)
    pool = _Pool(root_token, expand, cfg.value_temperature or 1.0)
    width = 1 if cfg.method == "chain" else cfg.expand_k
    frontier = torch.zeros(1, dtype=torch.int64)  # [f] pool ids, the root to start
    chosen = []  # the frontier picked at each level
    # A node at depth d brings its d - 1 ancestors with it, so levels deeper than
    # total_tokens - 1 can never be kept: they are not drafted.
    for _ in range(min(cfg.depth, cfg.total_tokens - 1)):
        kids = pool.add_children(frontier, width)  # [f * k']
        key = pool.logp[kids] if cfg.method == "no-value" else pool.values[kids]
        frontier = kids[best_positions(key, width)]  # [k]
        chosen.append(frontier)
    if cfg.method in ("eagle2", "no-value"):
        # Pool ids run level by level, so a stable sort by value ranks candidates by
        # (value desc, depth asc, creation asc). A child's value is its parent's plus
        # a log-prob <= 0, so never above it, and on a tie the shallower parent comes
        # first: every kept node's parent is kept and the tree is connected.
        keep = best_positions(pool.values[1:], cfg.total_tokens - 1) + 1
    else:
        keep = torch.cat([torch.zeros(0, dtype=torch.int64), *chosen])[: cfg.total_tokens - 1]
    return pool.tree(keep), torch.cat([torch.zeros(1, dtype=torch.int64), keep])


def _build_static(root_token: int, expand: ExpandFn, cfg: TreeParams) -> tuple[DraftTree, torch.Tensor]:
    """Grow a fixed shape level by level: each node that has children in the shape
    is expanded, and its children are the tokens at the requested ranks."""
    shape = cfg.static_shape if cfg.static_shape is not None else default_static_shape()
    # prefixes of a shape are connected trees, and dropping deep paths keeps that true
    paths = [p for p in shape if len(p) <= cfg.depth][: cfg.total_tokens - 1]
    pool = _Pool(root_token, expand, cfg.value_temperature or 1.0)
    index = {(): 0}  # rank path -> pool id
    for depth in range(1, max(map(len, paths), default=0) + 1):
        # a path whose parent needed a rank beyond the vocabulary is dropped too
        level = sorted((p for p in paths if len(p) == depth and p[:-1] in index),
                       key=lambda p: (index[p[:-1]], p[-1]))
        if not level:
            break
        heads = sorted({index[p[:-1]] for p in level})
        lp, tok = pool.top_children(torch.tensor(heads), max(p[-1] for p in level) + 1)  # [f, r]
        row = {h: j for j, h in enumerate(heads)}
        level = [p for p in level if p[-1] < tok.shape[1]]
        rows = torch.tensor([row[index[p[:-1]]] for p in level], dtype=torch.int64)
        ranks = torch.tensor([p[-1] for p in level], dtype=torch.int64)
        parents = torch.tensor([index[p[:-1]] for p in level], dtype=torch.int64)
        ids = pool.add(parents, tok[rows, ranks], lp[rows, ranks])
        index.update(zip(level, ids.tolist()))
    return pool.tree(torch.arange(1, len(pool))), torch.arange(len(pool))



# Sampled trees value a draw by a prior on its acceptance, not by its draft
# probability (a draw from a flat distribution is not less likely to be
# accepted than one from a peaked one). A node's first draw is taken to be
# accepted with probability 0.5 + 0.5 * q_max (a confident draft agrees more
# often), each further draw SAMPLED_NEXT_RATIO times the one before; the budget
# per level comes from the same priors with SAMPLED_FIRST_ACCEPT for the first
# draw. Measured with the demo family at T = 1 (4 draws a node, 8 prompts):
# the first draw is accepted 0.585 of the time, the second 0.050 (0.121 when
# the first was rejected), the third 0.014, the fourth 0.007.
SAMPLED_FIRST_ACCEPT = 0.6     # prior of a first draw, for the per-level budget
SAMPLED_NEXT_RATIO = 0.1
# A draw whose prior acceptance (along its path) is below this is not drafted,
# whatever the budget: it would add less than this to τ. On the 2-core CPU a
# tree node costs ~3% of a one-token step, and `specdec bench sweep
# --temperature 1` peaked at 8-12 nodes (1.27x) where 16 gave 1.09x.
SAMPLED_MIN_PRIOR = 0.03


def sampled_level_budget(total_tokens: int, depth: int, expand_k: int) -> list[int]:
    """Draws per level (1..depth) of a sampled tree: the level sizes of the
    ``total_tokens - 1`` rank paths of highest prior acceptance (the i-th draw
    at a node accepted with SAMPLED_FIRST_ACCEPT * SAMPLED_NEXT_RATIO^i, at most
    ``expand_k`` draws a node), leaving out paths whose prior is under
    SAMPLED_MIN_PRIOR."""
    import heapq

    log_a = [math.log(SAMPLED_FIRST_ACCEPT) + i * math.log(SAMPLED_NEXT_RATIO) for i in range(expand_k)]
    counts = [0] * depth
    heap = [(-log_a[0], 1, 0)]          # (-log value, depth, rank): a candidate rank path's last step
    for _ in range(total_tokens - 1):
        if not heap:
            break
        neg, d, rank = heapq.heappop(heap)
        if -neg < math.log(SAMPLED_MIN_PRIOR):
            break                      # the best path left is not worth a node
        counts[d - 1] += 1
        if rank + 1 < expand_k:        # the next draw at the same parent
            heapq.heappush(heap, (neg - log_a[rank + 1] + log_a[rank], d, rank + 1))
        if d < depth:                  # the first draw under this one
            heapq.heappush(heap, (neg - log_a[0], d + 1, 0))
    return counts


def _build_sampled(root_token: int, expand: ExpandFn, cfg: TreeParams,
                   sampler: ProposalSampler) -> tuple[DraftTree, torch.Tensor]:
    """Grow a tree of drawn children level by level (see the module docstring):
    every node of a level is expanded, then that level's draws are shared out."""
    pool = _Pool(root_token, expand)
    shape = None
    if cfg.method == "static":
        paths = cfg.static_shape if cfg.static_shape is not None else default_static_shape()
        shape = [p for p in paths if len(p) <= cfg.depth][: cfg.total_tokens - 1]
    elif cfg.method == "chain":
        budget = [1] * min(cfg.depth, cfg.total_tokens - 1)
    else:
        budget = sampled_level_budget(cfg.total_tokens, cfg.depth, cfg.expand_k)
    path_of = {0: ()}   # static: pool id -> the shape path it stands for
    frontier = torch.zeros(1, dtype=torch.int64)  # [f] pool ids
    for level in range(cfg.depth):
        if shape is not None:     # expand only the nodes the shape gives children
            kids = {n: sorted(p for p in shape if len(p) == level + 1 and p[:-1] == path_of[n])
                    for n in frontier.tolist()}
            frontier = frontier[[bool(kids[n]) for n in frontier.tolist()]]
        if len(frontier) == 0 or (shape is None and (level >= len(budget) or budget[level] == 0)):
            break
        tokens, q = (t.cpu() for t in sampler.proposals(pool.next_logp(frontier)))  # [f, s] each
        if not bool(torch.isfinite(q).all()):
            raise ValueError("the draft distribution has NaN or infinite entries")
        support = (q > 0).sum(-1).tolist()  # [f]
        first = torch.log(0.5 + 0.5 * q[:, 0].double())  # [f] log prior of each parent's first draw
        if shape is not None:     # the shape fixes the counts; the priors only value the draws
            counts = [min(len(kids[n]), s) for n, s in zip(frontier.tolist(), support)]
        else:
            # pool.logp holds each draw's log prior (its value's last term)
            key = pool.logp[frontier].double() if cfg.method == "no-value" else pool.values[frontier].double()
            counts = _share_draws(key + first, support, budget[level], cfg.expand_k)
        parents, drawn, gain = [], [], []
        for row, positions in enumerate(sampler.draw(q, counts)):
            if not positions:
                continue
            node = int(frontier[row])
            pool.proposals[node] = Proposal(tokens[row, :support[row]].clone(), q[row, :support[row]].clone())
            if shape is not None:
                path_of.update({len(pool) + len(parents) + j: p for j, p in enumerate(kids[node][:len(positions)])})
            parents += [node] * len(positions)
            drawn += tokens[row, positions].tolist()
            gain += [float(first[row]) + j * math.log(SAMPLED_NEXT_RATIO) for j in range(len(positions))]
        if not parents:
            break
        frontier = pool.add(torch.tensor(parents), torch.tensor(drawn), torch.tensor(gain, dtype=torch.float32))
    return pool.tree(torch.arange(1, len(pool))), torch.arange(len(pool))


def _share_draws(first: torch.Tensor, support: list[int], width: int, per_node: int) -> list[int]:
    """How many children each of f parents draws, ``width`` in all: the draws of
    highest worth, the i-th draw (from 0) at parent r worth
    first[r] + i * log(SAMPLED_NEXT_RATIO) (first [f]: the parent's path value
    plus its first draw's log prior). At most ``per_node`` and the parent's
    support each."""
    step = math.log(SAMPLED_NEXT_RATIO)
    slots = [(float(first[r]) + i * step, -r, -i) for r in range(len(support))
             for i in range(min(support[r], per_node, width))]
    counts = [0] * len(support)
    for _, r, _ in sorted(slots, reverse=True)[:width]:
        counts[-r] += 1
    return counts
