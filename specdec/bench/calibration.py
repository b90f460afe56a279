"""Draft confidence vs acceptance: the EAGLE-2 paper's Figure 6.

The paper's premise (§3.2) is that the draft model is well calibrated: a draft
token's confidence (its probability given its parent, under the draft model)
approximates the rate at which the target accepts it. To check it here, every
verified tree yields one point per *evaluated* node, (confidence, accepted):

- a node is evaluated when its parent is the root or was accepted: only then
  did the verifier compare it with the target's choice (a node under a
  rejected parent says nothing about its own token);
- it is accepted when it lies on the accepted path.

Points are binned by confidence into bins 0.05 wide; a calibrated drafter's
acceptance rate per bin sits on the diagonal.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

BIN_WIDTH = 0.05


def tree_points(values: Sequence[float], parents: Sequence[int],
                accepted: Iterable[int]) -> list[tuple[float, bool]]:
    """(confidence, accepted) of each evaluated node of one verified tree.

    values: [n] cumulative log-values (0 at the root), parents: [n] (-1 at the
    root), accepted: accepted node indices (root excluded), as in VerifyResult.
    """
    on_path = {0, *accepted}
    points = []
    for i in range(1, len(parents)):
        p = parents[i]
        if p not in on_path:
            continue
        confidence = math.exp(min(0.0, values[i] - values[p]))  # rounding may put it a hair above 1
        points.append((confidence, i in on_path))
    return points


def bin_index(confidence: float, n_bins: int) -> int:
    """[0, 1] -> 0 .. n_bins-1; confidence 1.0 falls in the last bin."""
    return min(max(int(confidence * n_bins), 0), n_bins - 1)


def calibration_bins(points: Iterable[tuple[float, bool]], width: float = BIN_WIDTH) -> list[dict]:
    """Acceptance rate per confidence bin: [{lo, hi, nodes, accepted, rate}], rate None when empty."""
    n_bins = round(1.0 / width)
    nodes, hits = [0] * n_bins, [0] * n_bins
    for confidence, ok in points:
        b = bin_index(confidence, n_bins)
        nodes[b] += 1
        hits[b] += bool(ok)
    return [{"lo": round(b / n_bins, 4), "hi": round((b + 1) / n_bins, 4), "nodes": nodes[b], "accepted": hits[b],
             "rate": round(hits[b] / nodes[b], 4) if nodes[b] else None} for b in range(n_bins)]


class TreeRecorder:
    """Stands in for a verifier engine and keeps (values, parents, accepted) of
    every tree it verifies; everything else goes to the engine untouched.
    Only references are kept on the hot path: points are computed afterwards."""

    def __init__(self, verifier):
        self._verifier = verifier
        self.trees: list[tuple[object, list[int]]] = []

    def verify(self, sid, tree):
        from specdec.tree.placed import host_tree

        result = self._verifier.verify(sid, tree)
        if tree.size > 1:
            self.trees.append((host_tree(tree), result.accepted))     # (read with the verdict already)
        return result

    def __getattr__(self, name):
        return getattr(self._verifier, name)

    def clear(self) -> None:
        self.trees.clear()

    def points(self) -> list[tuple[float, bool]]:
        out = []
        for tree, accepted in self.trees:
            out += tree_points(tree.values.tolist(), tree.parents.tolist(), accepted)
        return out
