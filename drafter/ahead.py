"""Drafting one round ahead as one forest: the next trees for the likeliest
outcomes of the tree being verified, drafted together (DESIGN.md §5, §6).

Vocabulary. Verifying the current tree ends in an *outcome*: an accepted path
(root to the node it stops at, its *end*) and a *bonus* token, the target's
next token there. The next cycle's tree is rooted at the bonus, on top of the
accepted tokens. Drafting ahead guesses outcomes and drafts their trees
before the verifier answers; a guess that comes true (a *hit*) saves a Draft
round trip, the tree is otherwise thrown away (output never changes).

Which outcomes. The drafter's node values estimate P(the path to i is
accepted) (``stop_scores``: P(stop at i) = P(reach i) times P(none of i's
children is accepted)); the bonus at an end is likely one of the drafter's own
top tokens there, never a child the current tree already had (the verifier
would have accepted it). So an outcome (end e, bonus b) has log-value
score(e) + log q_e(b), and a tree node under b adds its draft log-probs, as
EAGLE-2 values do (``specdec.tree.build``).

One forest. The accepted paths of the chosen ends are fed in one forward
(tree mask: each path node sees the committed prefix and its own ancestors;
its input is the drafter's own output at its parent, standing in for the
target's feature). Their ends' next-token distributions give the bonus
candidates (level 1); then each level expands the nodes of highest value
over all outcomes (EAGLE-2's frontier, ``expand_k`` for every two ends) in
one forward, so likelier outcomes get deeper trees and one forward per level
serves them all (a third of the drafter time of drafting each path's trees
on its own, measured with 4 and 8 ends). Each outcome's tree is then its bonus and the
``total_tokens - 1`` descendants of highest value within its depth limit (a
child's value never exceeds its parent's and ties go to the earlier node, so
the kept nodes stay connected), values relative to the bonus. The draft KV
slots are dropped afterwards: the session's cache keeps committed inputs only.

Cost. A level's host work is one top-k over all its rows and one mask write;
the bookkeeping is Python lists, the drafter's outputs one tensor per forward.
The demo family, compiled, one thread, in process with no budget (8 prompts,
96 tokens): a forest for 4 ends takes ~10 ms (16 ms when each row had its own
top-k and each mask was walked node by node), for 8 ends 12–17 ms (21–26),
about half of it the head's forwards; the trees are the same (τ 4.94 and 4.72
against 5.14 drafting fresh, ready in 58% and 76% of cycles).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from specdec.tree.layout import DraftTree, best_positions

# Nodes expanded per level: expand_k for every two outcomes' ends. Measured with
# the demo family (4 prompts, one thread): with 4 ends, a full expand_k per end
# had the next tree ready in 59% of cycles (τ 5.07, 30 ms a forest), half as
# many 60% (τ 5.21, 21 ms); with 8 ends 86% / 80% (τ 4.94 / 4.87, 59 / 35 ms).
FRONTIER_SHARE = 0.5

# (tokens [k], parent_hidden [k, H], positions [k], allowed [k, slots + k] bool,
#  key_positions [slots + k]) -> (hidden [k, H], log-probs [k, V]); appends k draft slots
StepFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Outcome:
    commit: list[int]        # accepted draft tokens + the bonus token
    tree: DraftTree          # the next cycle's tree if the verifier commits ``commit``
    hidden: torch.Tensor     # [n, H] the drafter's output at each node with children (zeros elsewhere)


def stop_scores(tree: DraftTree) -> torch.Tensor:
    """[n] log P(verifying ``tree`` stops at node i): value_i + log(1 - sum of
    its children's acceptance odds exp(value_c - value_i))."""
    parents = tree.parents[1:]
    odds = (tree.values[1:] - tree.values[parents]).exp()
    taken = torch.zeros(tree.size).index_add_(0, parents, odds)
    return tree.values + (1.0 - taken).clamp(min=1e-12).log()


def path_to(tree: DraftTree, node: int) -> list[int]:
    """Nodes from the root to ``node``, both included."""
    parents, path = tree.lists[1], [node]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    return path[::-1]


def likely_stops(tree: DraftTree, count: int) -> list[list[int]]:
    """The ``count`` accepted paths (tree nodes, root first) the drafter thinks
    most likely to be what verifying ``tree`` accepts, best first.

    Node i's value estimates P(path to i accepted) (the product of the draft
    probabilities along it, at the value temperature); the verifier stops there
    when the target's next token is none of i's children:
    P(stop at i) ~ exp(value_i) * (1 - sum over children c of exp(value_c - value_i))."""
    best = torch.sort(stop_scores(tree), descending=True, stable=True).indices[:count].tolist()
    return [path_to(tree, node) for node in best]


def tempered_tops(logp: torch.Tensor, k: int, temperature: float,
                  exclude: list[list[int]] | None = None) -> list[list[tuple[float, int]]]:
    """logp [m, V] -> for each row its k likeliest (log-prob at ``temperature``,
    token), best first, row r's ``exclude[r]`` kept out and the rest
    renormalised; tokens left at -inf are dropped. One top-k for all rows."""
    x = logp.float() / temperature                      # a new tensor: masked in place below
    if exclude and any(exclude):
        rows = [r for r, tokens in enumerate(exclude) for _ in tokens]
        x[rows, [t for tokens in exclude for t in tokens]] = -math.inf
    lp, tok = torch.topk(x - torch.logsumexp(x, dim=-1, keepdim=True), min(k, x.shape[-1]), dim=-1)
    return [[(p, t) for p, t in zip(ps, ts) if math.isfinite(p)] for ps, ts in zip(lp.tolist(), tok.tolist())]


class Forest:
    """The nodes drafted ahead: the current tree's path nodes, then the outcomes' nodes.
    Host bookkeeping is Python lists; the drafter's outputs stay one tensor per
    forward (``outputs``: row 0 the current root's, then one row per draft slot)."""

    def __init__(self, committed: int, root_pos: int, root_hidden: torch.Tensor):
        self.committed, self.root_pos = committed, root_pos
        self.tokens: list[int] = []
        self.parents: list[int] = []          # forest index, -1: the current root
        self.depths: list[int] = []           # below the current root
        self.values: list[float] = []
        self.children: list[list[int]] = []
        self.slot: dict[int, int] = {}        # forest index -> draft KV slot (after the committed ones)
        self.seen: dict[int, list[int]] = {}  # forest index -> the draft slots it sees: its ancestors' and its own
        self.outputs = [root_hidden[None]]
        self.key_positions = list(range(committed))

    def add(self, token: int, parent: int, depth: int, value: float) -> int:
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(depth)
        self.values.append(value)
        self.children.append([])
        if parent >= 0:
            self.children[parent].append(node)
        return node

    def output_rows(self, nodes: list[int]) -> list[int]:
        """Each node's row in the outputs: the current root's (0) for -1, the last
        row for a node that never ran (``draft_forest``'s table ends with a zero row)."""
        return [0 if n < 0 else self.slot[n] + 1 if n in self.slot else -1 for n in nodes]

    def outputs_at(self, nodes: list[int]) -> torch.Tensor:
        """[len(nodes), H] the drafter's outputs at ``nodes``, each of which ran (-1: the current root)."""
        return torch.cat(self.outputs)[self.output_rows(nodes)]

    def run(self, step: StepFn, nodes: list[int], parent_hidden: torch.Tensor) -> torch.Tensor:
        """One forward over ``nodes`` (topological order; each sees the prefix, its
        ancestors' slots, those in this forward too, and itself); they get slots
        and outputs; returns their log-probs [k, V]."""
        k, used = len(nodes), len(self.slot)
        rows, cols = [], []
        for row, node in enumerate(nodes):
            self.slot[node] = used + row
            parent = self.parents[node]
            seen = self.seen[node] = (self.seen[parent] if parent >= 0 else []) + [self.committed + used + row]
            rows.extend([row] * len(seen))
            cols.extend(seen)
        allowed = torch.zeros(k, self.committed + used + k, dtype=torch.bool)
        allowed[:, :self.committed] = True
        allowed[rows, cols] = True
        positions = [self.root_pos + self.depths[n] for n in nodes]
        self.key_positions.extend(positions)
        out_h, logp = step(torch.tensor([self.tokens[n] for n in nodes], dtype=torch.long), parent_hidden,
                           torch.tensor(positions, dtype=torch.long), allowed, torch.tensor(self.key_positions))
        self.outputs.append(out_h)
        return logp

    def outcome_tree(self, bonus: int, max_nodes: int, max_depth: int, table: torch.Tensor):
        """The tree rooted at forest node ``bonus`` and its record rows (from ``table``,
        the outputs with a zero row last)."""
        base, rest, level = self.depths[bonus], [], self.children[bonus]
        while level:                          # descendants within the depth limit
            level = [c for c in level if self.depths[c] - base <= max_depth]
            rest.extend(level)
            level = [g for c in level for g in self.children[c]]
        rest.sort()                           # creation order: by depth, then as drafted
        if len(rest) > max_nodes - 1:
            pick = best_positions(torch.tensor([self.values[i] for i in rest]), max(0, max_nodes - 1))
            rest = [rest[j] for j in pick.tolist()]
        keep = [bonus, *rest]
        where = {node: i for i, node in enumerate(keep)}
        tokens = [self.tokens[n] for n in keep]
        parents = [-1] + [where[self.parents[n]] for n in rest]
        depths = [self.depths[n] - base for n in keep]
        tree = DraftTree(torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64),
                         torch.tensor(depths, dtype=torch.int64),
                         torch.tensor([self.values[n] - self.values[bonus] for n in keep], dtype=torch.float32),
                         lists=(tokens, parents, depths))
        return tree, table[self.output_rows(keep)]


def draft_forest(step: StepFn, current: DraftTree, current_hidden: torch.Tensor, root_out: tuple,
                 committed: int, ends: list[tuple[int, float, int]], total_tokens: int, expand_k: int,
                 value_temperature: float) -> list[Outcome]:
    """The next trees for the outcomes at ``ends`` [(end node, log P(stop there),
    depth limit of its trees)], best first; see the module docstring.
    ``root_out``: the drafter's (hidden [H], log-probs [V]) at the current root;
    ``current_hidden`` [n, H]: its output at each node of ``current`` with children."""
    root_hidden, root_logp = root_out
    forest = Forest(committed, committed - 1, root_hidden)
    tokens, parents, depths = current.lists
    kids = current.children()
    paths = {end: path_to(current, end) for end, _, _ in ends}
    # the path nodes, as forest nodes 0.. in the current tree's (topological) order
    on_paths = sorted({n for path in paths.values() for n in path[1:]})
    at = {}
    for n in on_paths:
        at[n] = forest.add(tokens[n], at.get(parents[n], -1), depths[n], 0.0)
    logp_at = {0: root_logp}
    if on_paths:
        parent_h = torch.stack([root_hidden if parents[n] == 0 else current_hidden[parents[n]] for n in on_paths])
        logp = forest.run(step, [at[n] for n in on_paths], parent_h)
        logp_at.update({n: logp[row] for row, n in enumerate(on_paths)})
    # level 1: bonus candidates at each end
    bonuses: list[tuple[int, int, int]] = []       # (forest node, end, depth limit)
    tops = tempered_tops(torch.stack([logp_at[end] for end, _, _ in ends]), expand_k, value_temperature,
                         [[tokens[c] for c in kids[end]] for end, _, _ in ends])
    for (end, score, limit), top in zip(ends, tops):
        for p, t in top:
            bonuses.append((forest.add(t, at.get(end, -1), depths[end] + 1, score + p), end, limit))
    # deeper levels: the best `width` nodes of the last level, all outcomes at once
    width = expand_k * math.ceil(len(ends) * FRONTIER_SHARE)
    level = [b for b, _, _ in bonuses]
    limit_of = {b: limit for b, _, limit in bonuses}
    top_of = {b: b for b, _, _ in bonuses}                  # forest node -> its outcome's bonus node
    for _ in range(max((limit for _, _, limit in ends), default=0)):
        level = [n for n in level if forest.depths[n] - forest.depths[top_of[n]] < limit_of[top_of[n]]]
        if not level:
            break
        pick = best_positions(torch.tensor([forest.values[n] for n in level]), width).tolist()
        frontier = [level[j] for j in pick]
        logp = forest.run(step, frontier, forest.outputs_at([forest.parents[n] for n in frontier]))
        level = []
        for node, top in zip(frontier, tempered_tops(logp, expand_k, value_temperature)):
            for p, t in top:
                child = forest.add(t, node, forest.depths[node] + 1, forest.values[node] + p)
                top_of[child] = top_of[node]
                level.append(child)
    # the outputs on the host, with a zero row last for the nodes that never ran
    table = torch.cat([*forest.outputs, torch.zeros_like(root_hidden)[None]]).float().cpu()
    out = []
    for bonus, end, limit in bonuses:
        if bonus not in forest.slot:          # never expanded: a root-only tree is no tree to have ready
            continue
        tree, hidden = forest.outcome_tree(bonus, total_tokens, limit, table)
        accepted = [tokens[n] for n in paths[end][1:]]
        out.append(Outcome(accepted + [forest.tokens[bonus]], tree, hidden))
    return out
