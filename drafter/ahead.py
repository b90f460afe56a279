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
    stay = torch.ones(tree.size)
    for i, kids in enumerate(tree.children()):
        if kids:
            stay[i] = (1.0 - (tree.values[kids] - tree.values[i]).exp().sum()).clamp(min=1e-12)
    return tree.values + stay.log()


def path_to(tree: DraftTree, node: int) -> list[int]:
    """Nodes from the root to ``node``, both included."""
    parents, path = tree.parents.tolist(), [node]
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


def tempered_top(logp: torch.Tensor, k: int, temperature: float,
                 exclude: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logp [V] -> the k likeliest (log-probs at ``temperature``, tokens), ``exclude``
    kept out and the rest renormalised."""
    logp = logp.float() / temperature
    if exclude:
        logp = logp.clone()
        logp[exclude] = -math.inf
    lp, tok = torch.topk(logp - torch.logsumexp(logp, dim=-1), min(k, logp.shape[-1]))
    keep = torch.isfinite(lp)
    return lp[keep], tok[keep]


class Forest:
    """The nodes drafted ahead: the current tree's path nodes, then the outcomes' nodes."""

    def __init__(self, committed: int, root_pos: int):
        self.committed, self.root_pos = committed, root_pos
        self.tokens: list[int] = []
        self.parents: list[int] = []          # forest index, -1: the current root
        self.depths: list[int] = []           # below the current root
        self.values: list[float] = []
        self.slot: dict[int, int] = {}        # forest index -> draft KV slot (after the committed ones)
        self.hidden: dict[int, torch.Tensor] = {}
        self.key_positions = list(range(committed))

    def add(self, token: int, parent: int, depth: int, value: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(depth)
        self.values.append(value)
        return len(self.tokens) - 1

    def run(self, step: StepFn, nodes: list[int], parent_hidden: torch.Tensor) -> torch.Tensor:
        """One forward over ``nodes`` (each sees the prefix, its ancestors' slots and
        itself); they get slots and hidden states; returns their log-probs [k, V]."""
        k, used = len(nodes), len(self.slot)
        for row, node in enumerate(nodes):        # ancestors in the same forward are seen too
            self.slot[node] = used + row
        allowed = torch.zeros(k, self.committed + used + k, dtype=torch.bool)
        allowed[:, :self.committed] = True
        for row, node in enumerate(nodes):
            a = node
            while a >= 0:
                allowed[row, self.committed + self.slot[a]] = True
                a = self.parents[a]
        positions = torch.tensor([self.root_pos + self.depths[n] for n in nodes], dtype=torch.long)
        self.key_positions.extend(positions.tolist())
        tokens = torch.tensor([self.tokens[n] for n in nodes], dtype=torch.long)
        out_h, logp = step(tokens, parent_hidden, positions, allowed, torch.tensor(self.key_positions))
        for row, node in enumerate(nodes):
            self.hidden[node] = out_h[row]
        return logp

    def outcome_tree(self, bonus: int, max_nodes: int, max_depth: int, none: torch.Tensor):
        """The tree rooted at forest node ``bonus`` and its record rows."""
        inside = {bonus}
        rest = []
        for i in range(bonus + 1, len(self.tokens)):
            if self.parents[i] in inside and self.depths[i] - self.depths[bonus] <= max_depth:
                inside.add(i)
                rest.append(i)
        if len(rest) > max_nodes - 1:
            pick = best_positions(torch.tensor([self.values[i] for i in rest]), max(0, max_nodes - 1))
            rest = [rest[j] for j in pick.tolist()]
        keep = [bonus, *rest]
        where = {node: i for i, node in enumerate(keep)}
        tree = DraftTree(torch.tensor([self.tokens[n] for n in keep], dtype=torch.int64),
                         torch.tensor([-1] + [where[self.parents[n]] for n in rest], dtype=torch.int64),
                         torch.tensor([self.depths[n] - self.depths[bonus] for n in keep], dtype=torch.int64),
                         torch.tensor([self.values[n] - self.values[bonus] for n in keep], dtype=torch.float32))
        return tree, torch.stack([self.hidden.get(n, none) for n in keep])


def draft_forest(step: StepFn, current: DraftTree, current_hidden: torch.Tensor, root_out: tuple,
                 committed: int, ends: list[tuple[int, float, int]], total_tokens: int, expand_k: int,
                 value_temperature: float) -> list[Outcome]:
    """The next trees for the outcomes at ``ends`` [(end node, log P(stop there),
    depth limit of its trees)], best first; see the module docstring.
    ``root_out``: the drafter's (hidden [H], log-probs [V]) at the current root;
    ``current_hidden`` [n, H]: its output at each node of ``current`` with children."""
    root_hidden, root_logp = root_out
    forest = Forest(committed, committed - 1)
    kids = current.children()
    # the path nodes, as forest nodes 0.. in the current tree's (topological) order
    on_paths = sorted({n for end, _, _ in ends for n in path_to(current, end)[1:]})
    at = {}
    for n in on_paths:
        parent = int(current.parents[n])
        at[n] = forest.add(int(current.tokens[n]), at.get(parent, -1), int(current.depths[n]), 0.0)
    logp_at = {0: root_logp}
    if on_paths:
        parent_h = torch.stack([root_hidden if int(current.parents[n]) == 0 else current_hidden[int(current.parents[n])]
                                for n in on_paths])
        logp = forest.run(step, [at[n] for n in on_paths], parent_h)
        logp_at.update({n: logp[row] for row, n in enumerate(on_paths)})
    # level 1: bonus candidates at each end
    bonuses: list[tuple[int, int, int]] = []       # (forest node, end, depth limit)
    for end, score, limit in ends:
        taken = current.tokens[kids[end]].tolist()
        lp, tok = tempered_top(logp_at[end], expand_k, value_temperature, taken)
        for p, t in zip(lp.tolist(), tok.tolist()):
            node = forest.add(t, at.get(end, -1), int(current.depths[end]) + 1, score + p)
            bonuses.append((node, end, limit))
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
        parent_h = torch.stack([forest.hidden[forest.parents[n]] if forest.parents[n] >= 0 else root_hidden
                                for n in frontier])
        logp = forest.run(step, frontier, parent_h)
        level = []
        for row, node in enumerate(frontier):
            lp, tok = tempered_top(logp[row], expand_k, value_temperature)
            for p, t in zip(lp.tolist(), tok.tolist()):
                child = forest.add(t, node, forest.depths[node] + 1, forest.values[node] + p)
                top_of[child] = top_of[node]
                level.append(child)
    none = torch.zeros_like(root_hidden)
    out = []
    for bonus, end, limit in bonuses:
        if bonus not in forest.hidden:        # never expanded: a root-only tree is no tree to have ready
            continue
        tree, hidden = forest.outcome_tree(bonus, total_tokens, limit, none)
        accepted = current.tokens[path_to(current, end)[1:]].tolist()
        out.append(Outcome(accepted + [forest.tokens[bonus]], tree, hidden.float().cpu()))
    return out
