"""Lookahead decoding: the target drafts for itself, no draft model, no training.

Reference: Fu et al., "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding" (2024), https://arxiv.org/abs/2402.02057; parameters as in
TensorRT-LLM's lookahead decoding (window W, n-gram size N, guess set G).

Vocabulary:
- root x_t: the session's pending token (node 0 of every tree, position t).
- window: a 2-D Jacobi window of N - 1 rows. Row 0 holds W - 1 guesses (its
  column 0 is the root itself), rows 1..N-2 hold W. Cell (r, j) sits at
  position t + r + j and sees the committed prefix, the root, row 0's cells at
  columns <= j and the cells (1..r, j) of its own column: the consecutive
  positions t .. t + r + j, so its logits are a Jacobi update of the token
  after it.
- lookahead branch: the window's cells in one forward; the argmax at each
  cell of the last row is that column's new token.
- n-gram: a column read top to bottom plus its new token (N tokens), keyed by
  its first token (row 0's cell, the root for column 0).
- pool: per key at most G n-grams, least recently added first out (LRU);
  seeded with the prompt's n-grams.
- verification branch: the pool's (N - 1)-token continuations of x_t (up to
  G) merged into a trie rooted at x_t: an ordinary ``DraftTree`` that the
  verifier's tree verify and exact acceptance take as any drafter's (fixed
  tokens: one-hot proposals at T > 0).

Both branches run in one target forward: the tree's nodes first (the
ancestor mask), then the window's cells (``window_allowed``), whose K/V is
dropped at commit like any rejected node's. After the step the window slides
by one row (row 1 without its first cell becomes row 0, ..., the new tokens
the last row) whatever the step accepted, as the reference does: the window
keeps Jacobi-iterating around the moving root; every n-gram it yields is only
a guess, verified before anything is committed, so its contents never change
the output, only how much of it each cycle accepts.

The window starts from random vocabulary tokens (as the reference does), from a
generator of its own seeded per session: the session's sampling generator is
never touched, so sampled output is the same with and without lookahead.
"""

from __future__ import annotations

import functools
from collections import OrderedDict

import torch

from specdec.request.lookahead import LookaheadParams
from specdec.tree.layout import DraftTree, tree_from_lists

class NgramPool:
    """n-grams keyed by their first token: per key the last ``guesses`` distinct
    continuations added (re-adding one makes it the most recent)."""

    def __init__(self, ngram: int, guesses: int):
        self.ngram, self.guesses = ngram, guesses
        self.table: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, gram: tuple[int, ...]) -> None:
        """One n-gram (N tokens)."""
        key, rest = gram[0], tuple(gram[1:])
        grams = self.table.setdefault(key, OrderedDict())
        if rest in grams:
            grams.move_to_end(rest)
            return
        grams[rest] = None
        if len(grams) > self.guesses:
            grams.popitem(last=False)

    def add_sequence(self, tokens: list[int]) -> None:
        """Every n-gram of ``tokens`` (the prompt's, to seed the pool)."""
        n = self.ngram
        for i in range(len(tokens) - n + 1):
            self.add(tuple(tokens[i:i + n]))

    def continuations(self, key: int) -> list[tuple[int, ...]]:
        """The (N - 1)-token continuations of ``key``, the most recent first."""
        return list(reversed(self.table.get(key, ())))


def guess_tree(root: int, guesses: list[tuple[int, ...]], depth: int) -> DraftTree:
    """The guesses, each cut to ``depth`` tokens, merged into a trie rooted at
    ``root``: nodes level by level, siblings in the order their first guess
    comes (the most recent first), shared prefixes once."""
    children: list[dict[int, int]] = [{}]        # node -> {token: child node}, creation order
    trie_tokens, trie_parents, trie_depths = [root], [-1], [0]
    for gram in guesses:
        node = 0
        for token in gram[:depth]:
            if token not in children[node]:
                children[node][token] = len(trie_tokens)
                children.append({})
                trie_tokens.append(token)
                trie_parents.append(node)
                trie_depths.append(trie_depths[node] + 1)
            node = children[node][token]
    # level order (the layout's: parents before children, by depth then creation)
    order = sorted(range(len(trie_tokens)), key=lambda i: (trie_depths[i], i))
    index = {old: new for new, old in enumerate(order)}
    return tree_from_lists([trie_tokens[i] for i in order],
                           [-1 if trie_parents[i] < 0 else index[trie_parents[i]] for i in order])


@functools.lru_cache(maxsize=32)
def window_layout(window: int, ngram: int) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """The window's cells in forward order, (row, column), row by row (row 0 from
    column 1), and what each sees: bool [cells, 1 + cells], column 0 the root."""
    cells = [(0, j) for j in range(1, window)] + [(r, j) for r in range(1, ngram - 1) for j in range(window)]
    slot = {cell: 1 + i for i, cell in enumerate(cells)}
    slot[(0, 0)] = 0                                             # the root is row 0's column 0
    allowed = torch.zeros(len(cells), 1 + len(cells), dtype=torch.bool)
    for i, (r, j) in enumerate(cells):
        seen = [(0, c) for c in range(j + 1)] + [(s, j) for s in range(1, r + 1)]
        allowed[i, [slot[cell] for cell in seen]] = True
    return cells, allowed


def window_offsets(window: int, ngram: int) -> torch.Tensor:
    """[cells] int64: each cell's position after the root's (r + j)."""
    cells, _ = window_layout(window, ngram)
    return torch.tensor([r + j for r, j in cells], dtype=torch.int64)


def lookahead_allowed(ancestor: torch.Tensor, window_sees: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """bool [n + m, prefix_len + n + m] for one forward of a tree (ancestor
    [n, n]) and then m window cells (``window_layout``'s [m, 1 + m]): every
    token sees the committed prefix; tree nodes their ancestors; cells the
    root (tree node 0) and the cells they see; no tree node sees a cell, no
    cell a guess."""
    n, m = ancestor.shape[0], window_sees.shape[0]
    allowed = torch.zeros(n + m, prefix_len + n + m, dtype=torch.bool)
    allowed[:, :prefix_len] = True
    allowed[:n, prefix_len:prefix_len + n] = ancestor
    allowed[n:, prefix_len] = window_sees[:, 0]
    allowed[n:, prefix_len + n:] = window_sees[:, 1:]
    return allowed


class JacobiWindow:
    """The window's tokens: ``rows[0]`` the W - 1 cells of row 0 (columns 1..W-1),
    ``rows[r]`` the W cells of row r for r in 1..N-2."""

    def __init__(self, params: LookaheadParams, vocab_size: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        w, n = params.window, params.ngram
        draws = torch.randint(vocab_size, (max(w * (n - 1) - 1, 0),), generator=generator).tolist()
        self.params = params
        self.rows = [draws[:w - 1]] + [draws[w - 1 + (r - 1) * w:w - 1 + r * w] for r in range(1, n - 1)]

    def tokens(self) -> list[int]:
        """The cells' tokens in forward order (``window_layout``)."""
        return [t for row in self.rows for t in row]

    def step(self, root: int, root_next: int, cell_next: list[int]) -> list[tuple[int, ...]]:
        """After a forward: ``root_next`` the argmax at the root, ``cell_next`` at
        each cell (forward order). Returns the W n-grams of the columns and
        slides the window by one row."""
        w = self.params.window
        last = [root_next] + cell_next[:w - 1] if len(self.rows) == 1 else cell_next[-w:]
        top = [root] + self.rows[0]
        columns = [[top[j]] + [row[j] for row in self.rows[1:]] + [last[j]] for j in range(w)]
        rows = self.rows[1:] + [last]
        self.rows = [rows[0][1:]] + rows[1:]
        return [tuple(column) for column in columns]


class LookaheadState:
    """One session's lookahead decoding: its pool and its window."""

    def __init__(self, params: LookaheadParams, vocab_size: int, tokens: list[int], seed: int = 0):
        self.params = params
        self.pool = NgramPool(params.ngram, params.guesses)
        self.pool.add_sequence(tokens)
        self.window = JacobiWindow(params, vocab_size, seed)

    def tree(self, root: int, depth: int) -> DraftTree:
        """This step's verification branch, at most ``depth`` levels below the root."""
        return guess_tree(root, self.pool.continuations(root), min(depth, self.params.ngram - 1))

    def update(self, root: int, root_next: int, cell_next: list[int]) -> None:
        """The lookahead branch's argmaxes into the pool; the window slides."""
        for gram in self.window.step(root, root_next, cell_next):
            self.pool.add(gram)
