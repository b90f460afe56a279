"""The draft tree's layout: the flattened form every component exchanges.

Layout (also the wire format): tokens[n] and parents[n] with parents[0] == -1 and
0 <= parents[i] < i for i >= 1; nodes sorted by (depth, creation index); see
``specdec.tree.build`` for the vocabulary and the builders.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from specdec.tree.proposals import Proposal


def best_positions(key: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k largest keys (ties: earlier first), in ascending order."""
    return torch.sort(key, descending=True, stable=True).indices[:k].sort().values


class TreeError(ValueError):
    """A draft tree that breaks the layout rules above."""


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor  # [n] int64
    parents: torch.Tensor  # [n] int64, -1 at the root
    depths: torch.Tensor  # [n] int64
    values: torch.Tensor  # [n] float32 log-values, 0 at the root
    # node -> the distribution its children were drawn from (sampled proposals);
    # None / absent nodes: children are fixed tokens (one-hot proposals)
    proposals: dict[int, Proposal] | None = None
    # the host's copy of the structure, (tokens, parents, depths) as lists: given by whoever
    # holds them (the wire, a builder that chose the nodes on the host), else read once here.
    # Checks, acceptance and the tree's masks read the structure from it, never from the tensors
    # (a ``dataclasses.replace`` of tokens, parents or depths passes ``lists=None`` with them)
    lists: tuple[list[int], list[int], list[int]] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        n = self.tokens.shape[0] if isinstance(self.tokens, torch.Tensor) and self.tokens.dim() == 1 else -1
        for name, dtype in (("tokens", torch.int64), ("parents", torch.int64),
                            ("depths", torch.int64), ("values", torch.float32)):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.shape != (n,):
                raise TreeError(f"{name} must be a {dtype} tensor of shape [{n}]")
        if self.lists is None:
            object.__setattr__(self, "lists", (self.tokens.tolist(), self.parents.tolist(), self.depths.tolist()))
        toks, pars, depths = self.lists
        if not len(toks) == len(pars) == len(depths) == n:
            raise TreeError(f"the host lists of a tree of {n} nodes have {len(toks)}, {len(pars)}, {len(depths)}")
        _checked(toks, pars, None)
        if depths != _depths(pars):
            raise TreeError("depths do not match parents")
        if self.proposals is not None and any(not 0 <= k < n for k in self.proposals):
            raise TreeError("proposals name a node outside the tree")

    @property
    def token_list(self) -> list[int]:
        return self.lists[0]

    @property
    def parent_list(self) -> list[int]:
        return self.lists[1]

    @property
    def depth_list(self) -> list[int]:
        return self.lists[2]

    @property
    def size(self) -> int:
        return len(self.tokens)

    def ancestor_mask(self) -> torch.Tensor:
        """bool [n, n]: row i is True at i and at each of its ancestors (built on
        the host from the parents, as the masks built from it are)."""
        parents = self.parent_list
        rows: list[list[bool]] = []
        for i, parent in enumerate(parents):
            row = rows[parent].copy() if parent >= 0 else [False] * len(parents)   # the parent's ancestors
            row[i] = True
            rows.append(row)
        return torch.tensor(rows, dtype=torch.bool)

    def position_ids(self, prefix_len: int) -> torch.Tensor:
        """[n] int64: each node sits after the prefix, at its own depth."""
        return prefix_len + self.depths

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(self.size)]
        for i, p in enumerate(self.parent_list[1:], start=1):
            kids[p].append(i)
        return kids

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node lists, one per leaf, leaves in index order."""
        parents = self.parent_list
        out = []
        for leaf, kids in enumerate(self.children()):
            if kids:
                continue
            path = [leaf]
            while path[-1] != 0:
                path.append(parents[path[-1]])
            out.append(path[::-1])
        return out

    def expected_accepted(self) -> float:
        """Expected accepted draft tokens (EAGLE-2): the sum of node probabilities."""
        return float(self.values[1:].exp().sum())

    def to_lists(self) -> tuple[list[int], list[int]]:
        return list(self.token_list), list(self.parent_list)


def subtree(tree: DraftTree, root: int, max_nodes: int) -> tuple[DraftTree, torch.Tensor]:
    """The nodes under ``root`` as a tree of their own: ``root`` and the
    ``max_nodes - 1`` descendants of highest value (a child's value never
    exceeds its parent's, ties go to the shallower node, so what is kept stays
    connected); depths and values relative to ``root``. Returns it with the
    kept node indices ([m] int64, ``root`` first). Proposals are not carried:
    a cut may drop drawn children, and fixed-token acceptance of what is kept
    stays exact."""
    parents = tree.parent_list
    inside = [False] * tree.size
    inside[root] = True
    for i in range(root + 1, tree.size):
        inside[i] = inside[parents[i]]
    rest = torch.tensor([i for i in range(root + 1, tree.size) if inside[i]], dtype=torch.int64)
    if len(rest) > max_nodes - 1:
        rest = rest[best_positions(tree.values[rest], max(0, max_nodes - 1))]
    keep = torch.cat([torch.tensor([root], dtype=torch.int64), rest])
    where = torch.full((tree.size,), -1, dtype=torch.int64)
    where[keep] = torch.arange(len(keep))
    new_parents = where[tree.parents[keep].clamp(min=0)]
    new_parents[0] = -1
    return DraftTree(tree.tokens[keep], new_parents, tree.depths[keep] - tree.depths[root],
                     tree.values[keep] - tree.values[root]), keep


def _int_list(x, name: str) -> list[int]:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise TreeError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise TreeError(f"{name} must hold integers, got dtype {x.dtype}")
        return x.tolist()
    if isinstance(x, (str, bytes)):
        raise TreeError(f"{name} must be a list or 1-D tensor of integers")
    try:
        items = list(x)
    except TypeError:
        raise TreeError(f"{name} must be a list or 1-D tensor of integers") from None
    out = []
    for i, v in enumerate(items):
        try:
            if isinstance(v, bool):
                raise TypeError
            out.append(operator.index(v))
        except TypeError:
            raise TreeError(f"{name}[{i}] = {v!r} is not an integer") from None
    return out


def _checked(tokens, parents, vocab_size: int | None) -> tuple[list[int], list[int]]:
    toks, pars = _int_list(tokens, "tokens"), _int_list(parents, "parents")
    if len(toks) != len(pars):
        raise TreeError(f"tokens and parents differ in length ({len(toks)} vs {len(pars)})")
    if not toks:
        raise TreeError("tree is empty: it needs at least the root")
    if pars[0] != -1:
        raise TreeError(f"parents[0] = {pars[0]}: node 0 is the root and must have parent -1")
    for i, p in enumerate(pars[1:], start=1):
        if not 0 <= p < i:
            raise TreeError(f"parents[{i}] = {p} is not in [0, {i}): "
                            "node 0 is the only root and parents come before their children")
    for i, t in enumerate(toks):
        if t < 0:
            raise TreeError(f"tokens[{i}] = {t} is negative")
        if vocab_size is not None and t >= vocab_size:
            raise TreeError(f"tokens[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
    return toks, pars


def validate_tree(tokens, parents, vocab_size: int | None = None) -> None:
    """Raise TreeError naming the first problem with the (tokens, parents) tree."""
    _checked(tokens, parents, vocab_size)


def _depths(parents: list[int]) -> list[int]:
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return depths


def tree_from_lists(tokens, parents, vocab_size: int | None = None) -> DraftTree:
    """A validated DraftTree from the wire form; values are zeros (unknown)."""
    toks, pars = _checked(tokens, parents, vocab_size)
    depths = _depths(pars)
    tokens_, parents_, depths_ = torch.tensor([toks, pars, depths], dtype=torch.int64)   # one copy up
    return DraftTree(tokens_, parents_, depths_, torch.zeros(len(toks), dtype=torch.float32),
                     lists=(toks, pars, depths))
