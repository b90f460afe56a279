"""Static draft-tree shapes (EAGLE-1 / Medusa style) for the "static" tree method.

A shape is a tuple of rank paths: ``(0,)`` is the root's most likely child,
``(0, 1)`` that child's second most likely child, and so on. Shapes are ordered
so that every path's parent comes earlier; any prefix of a shape is then a
valid, connected tree, which is how a shape is cut down to ``total_tokens``.
"""

from __future__ import annotations

import heapq
from functools import lru_cache

Shape = tuple[tuple[int, ...], ...]

# Assumed chance that the draft's rank-r token is accepted, independent of depth.
# Deliberately steep: the default shape spends its budget on low ranks and
# shallow levels, where a fixed tree is right most often.
RANK_PRIOR = (0.6, 0.16, 0.07, 0.04, 0.025, 0.017, 0.012, 0.009, 0.007, 0.005)


@lru_cache(maxsize=None)
def default_static_shape(size: int = 59, max_depth: int = 6) -> Shape:
    """The ``size`` rank paths most likely to be accepted under ``RANK_PRIOR``.

    Best-first search: a path's score is the product of its ranks' priors, so a
    child never scores above its parent; ties go to the shorter, then the
    lexicographically smaller path. Pop order is therefore a topological order.
    """
    heap = [(-q, 1, (r,)) for r, q in enumerate(RANK_PRIOR)]
    heapq.heapify(heap)
    shape = []
    while heap and len(shape) < size:
        neg_score, depth, path = heapq.heappop(heap)
        shape.append(path)
        if depth < max_depth:
            for r, q in enumerate(RANK_PRIOR):
                heapq.heappush(heap, (neg_score * q, depth + 1, path + (r,)))
    return tuple(shape)


def check_shape(shape: Shape) -> None:
    """Raise ValueError unless ``shape`` is a non-empty list of distinct rank
    paths (ranks >= 0), each listed after its parent path."""
    if not shape:
        raise ValueError("static_shape is empty")
    seen: set[tuple[int, ...]] = set()
    for i, path in enumerate(shape):
        if not isinstance(path, tuple) or not path:
            raise ValueError(f"static_shape[{i}] must be a non-empty tuple of ranks, got {path!r}")
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in path):
            raise ValueError(f"static_shape[{i}] = {path!r}: ranks must be integers >= 0")
        if path in seen:
            raise ValueError(f"static_shape[{i}] = {path!r} is listed twice")
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(f"static_shape[{i}] = {path!r}: parent path {path[:-1]!r} must come earlier")
        seen.add(path)


# Medusa's default static tree, ``mc_sim_7b_63`` (Cai et al., Medusa,
# arXiv:2401.10774; FasterDecoding/Medusa ``medusa_choices.py``): 63 rank paths
# over four heads, 10 / 28 / 23 / 2 nodes at depths 1-4, listed in the order the
# reference lists them (by simulated acceptance on Vicuna-7B), every path after
# its parent, so a prefix of it is a connected tree.
MEDUSA_MC_SIM_7B_63: Shape = tuple(tuple(p) for p in (
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5],
    [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8], [9],
    [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1],
    [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0],
    [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0],
    [0, 0, 0, 1], [1, 6], [0, 7, 0]))


def shape_from_choices(choices, where: str = "choices") -> Shape:
    """A Medusa choices list (JSON: a list of rank paths such as [[0], [0, 0], [1]])
    as a shape; paths are reordered by depth (stably) so each follows its parent.
    ValueError naming ``where`` unless it is a valid shape."""
    if not isinstance(choices, list) or not all(isinstance(p, list) for p in choices):
        raise ValueError(f"{where}: expected a JSON list of rank paths such as [[0], [0, 0], [1]]")
    shape = tuple(sorted((tuple(p) for p in choices), key=len))
    try:
        check_shape(shape)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return shape
