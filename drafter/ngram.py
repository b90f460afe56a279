"""Prompt-lookup (n-gram) drafter: no model, proposals copied from the context.

For a context, the next-token distribution is the empirical distribution of
the tokens that followed the longest earlier occurrence (n = max_n .. min_n) of
its last n tokens. Plugged into the same tree builder as the model drafters,
every tree method works; tokens never seen after a match get probability 0
and are pruned from the tree.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import torch

from specdec.request.params import TreeParams
from specdec.tree.build import DraftTree, Frontier, build_tree
from drafter.base import DraftSession, Drafter


class NgramIndex:
    """n-gram -> Counter of following tokens, for n in [1, max_n], built incrementally."""

    def __init__(self, max_n: int):
        self.max_n = max_n
        self.follow: dict[tuple[int, ...], Counter] = defaultdict(Counter)
        self.indexed = 0                  # positions i whose (context -> tokens[i]) are recorded

    def update(self, tokens: list[int]) -> None:
        for i in range(max(1, self.indexed), len(tokens)):
            for n in range(1, min(self.max_n, i) + 1):
                self.follow[tuple(tokens[i - n:i])][tokens[i]] += 1
        self.indexed = len(tokens)

    def lookup(self, context: list[int], min_n: int) -> Counter | None:
        for n in range(min(self.max_n, len(context)), min_n - 1, -1):
            counts = self.follow.get(tuple(context[-n:]))
            if counts:
                return counts
        return None


def prune_impossible(tree: DraftTree) -> DraftTree:
    """Drop nodes of value -inf (and so their subtrees), keeping order."""
    keep = torch.isfinite(tree.values)
    if bool(keep.all()):
        return tree
    new_index = torch.cumsum(keep.long(), 0) - 1
    parents = tree.parents[keep]
    parents = torch.where(parents >= 0, new_index[parents.clamp(min=0)], parents)
    return DraftTree(tokens=tree.tokens[keep], parents=parents, depths=tree.depths[keep], values=tree.values[keep])


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, vocab_size: int, max_n: int = 4, min_n: int = 1,
                 max_sessions: int = 64, ttl_s: float = 600.0):
        super().__init__(vocab_size, max_sessions, ttl_s)
        self.max_n, self.min_n = max_n, min_n

    def _distribution(self, context: list[int], index: NgramIndex) -> torch.Tensor:
        logp = torch.full((self.vocab_size,), -math.inf)
        counts = index.lookup(context, self.min_n)
        if counts:
            total = sum(counts.values())
            ids = torch.tensor(list(counts.keys()))
            logp[ids] = torch.tensor([math.log(c / total) for c in counts.values()])
        return logp

    def draft_session(self, sess: DraftSession, cfg: TreeParams) -> DraftTree:
        if sess.state is None:
            sess.state = NgramIndex(self.max_n)
        index: NgramIndex = sess.state
        index.update(sess.tokens[:-1])    # don't match the root against itself
        path_tokens: dict[int, list[int]] = {0: []}

        def expand(frontier: Frontier) -> torch.Tensor:
            rows = []
            for node, parent, token in zip(frontier.nodes.tolist(), frontier.parents.tolist(),
                                           frontier.tokens.tolist()):
                path_tokens[node] = [] if parent < 0 else path_tokens[parent] + [token]
                rows.append(self._distribution((sess.tokens[-self.max_n:] + path_tokens[node])[-self.max_n:], index))
            return torch.stack(rows)

        return prune_impossible(build_tree(sess.tokens[-1], expand, cfg))
