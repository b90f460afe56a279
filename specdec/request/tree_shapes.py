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
