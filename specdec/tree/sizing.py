"""Draft trees sized by what a verify costs on this verifier (DESIGN.md §6).

A drafted tree's node values say how many of its tokens the target is likely
to accept: a node's value is the log of the product of draft confidences on
its path, and with calibrated confidences exp(value) estimates the chance the
node is accepted. The n best nodes of a tree (the root and the n - 1 of
highest value) are expected to commit 1 + S(n) tokens, S(n) the sum of their
exp(value) (the bonus token is the 1), in a cycle of the session's other work
(drafting, the network, the loop: the *gap* between its verifies, whatever n)
plus a verify of n nodes, cost(n).

What is maximised is the session's rate over all its cycles, not one cycle's
ratio: a cycle whose tree is poor should not be cut to the size that is best
for that poor cycle alone. With r the rate the session runs at (tokens per
second over its recent cycles), the size kept is

    n* = argmax_n  S(n) - r * cost(n)

(the renewal-reward rule: a node is worth verifying when the tokens it is
expected to add exceed what the session commits in the time it costs), over
n in 1, 2, 4, ... up to the drafted size (a compiled verifier pads a forward
to its next width of 1, 2, 4, ..., so every size between two widths costs
what the upper one does). cost(n) is measured, not modelled: the verifier
times its own verifies per width (an exponential average) and each session's
cycles. Widths never timed, or not timed for ``EXPLORE_EVERY`` verifies, are
verified at their size to (re)measure them (a width's very first verify is not
counted: it may have opened a compiled graph).

Only greedy sessions' trees are cut. Greedy output never depends on the tree;
a sampled session's output distribution would not either for fixed-token
proposals, but its draws would depend on the verifier's timings, and a seeded
request must give the same tokens every time. Trees with sampled proposals
are never cut (their draws are accepted as drawn).

The cut keeps a connected tree: values are first made non-increasing down
every path (a node's value at most its parent's, whatever a remote drafter
sent), and the kept nodes are the best by (value desc, index asc), so a
node's parent always ranks before it (``specdec.tree.layout.subtree``).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from specdec.tree.layout import DraftTree, TreeError, subtree

SMOOTHING = 0.25            # weight of the newest measurement in a cost or rate average
SPIKE = 3.0                 # a measurement counts as at most this many times the average it updates
EXPLORE_EVERY = 200         # verifies after which a width not timed since is timed again
MAX_SESSIONS = 4096         # sessions whose pace is remembered (least recently verified dropped first)

__all__ = ["EXPLORE_EVERY", "TreeSizer", "best_size", "restore", "sizes_up_to", "width_of"]


def restore(accepted: list[int], keep: torch.Tensor | None) -> list[int]:
    """Accepted node indices of a cut tree as indices of the drafted one (``keep``: ``TreeSizer.cut``'s)."""
    return accepted if keep is None else keep[accepted].tolist()


def width_of(n: int) -> int:
    """The width a verify of ``n`` nodes is timed under: the next power of two."""
    return 1 << (n - 1).bit_length()


def sizes_up_to(cap: int) -> list[int]:
    """The sizes a tree of ``cap`` nodes may be cut to: 1, 2, 4, ... below it, and ``cap``."""
    return [1 << k for k in range(cap.bit_length()) if 1 << k < cap] + [cap]


def best_size(accept: list[float], costs: dict[int, float], rate: float, cap: int) -> int:
    """The size n in ``sizes_up_to(cap)`` maximising S(n) - rate * cost(n):
    ``accept`` [cap - 1] the non-root nodes' acceptance estimates, best first;
    ``costs`` a verify's seconds per width (every needed width); ``rate`` the
    session's tokens per second. Ties go to the larger size."""
    prefix = [0.0]
    for p in accept:
        prefix.append(prefix[-1] + p)
    best, best_gain = cap, float("-inf")
    for n in sizes_up_to(cap):
        gain = prefix[n - 1] - rate * costs[width_of(n)]
        if gain >= best_gain:
            best, best_gain = n, gain
    return best


def averaged(old: float | None, new: float) -> float:
    """An exponential average moved by ``new`` (counted as at most ``SPIKE`` times ``old``)."""
    return new if old is None else old + SMOOTHING * (min(new, SPIKE * old) - old)


def monotone_values(tree: DraftTree) -> torch.Tensor:
    """The tree's values with each node's capped at its parent's ([n] fp32, topological order)."""
    values = tree.values.tolist()
    parents = tree.parents.tolist()
    for i in range(1, len(values)):
        values[i] = min(values[i], values[parents[i]])
    return torch.tensor(values, dtype=torch.float32)


@dataclass
class Pace:
    """One session's recent cycles: when its last verify ended, tokens and seconds per cycle (averaged)."""

    verified_at: float | None = None
    started_at: float | None = None     # when the cycle being verified began (its gap's start)
    tokens: float | None = None
    seconds: float | None = None

    @property
    def rate(self) -> float | None:
        return None if self.tokens is None or not self.seconds else self.tokens / self.seconds


class TreeSizer:
    """One verifier's tree sizing: verify costs per width (shared by its
    sessions), each session's pace. Thread-safe (the verifier's RPCs and its
    worker thread both call it)."""

    def __init__(self):
        self.costs: dict[int, float] = {}           # width -> averaged seconds of a verify
        self.timed_at: dict[int, int] = {}          # width -> verify count when last timed
        self.warmed: set[int] = set()               # widths verified once (their first verify is not timed)
        self.verifies = 0
        self.rate: float | None = None              # tokens per second, averaged over every session's cycles
        self.sessions: OrderedDict[str, Pace] = OrderedDict()
        self.lock = threading.Lock()

    def cut(self, sid: str, tree: DraftTree, greedy: bool) -> tuple[DraftTree, torch.Tensor | None]:
        """The tree to verify for ``sid`` this cycle, and the kept node indices
        ([m] int64, ascending, root first) when it was cut (None: the whole tree)."""
        with self.lock:
            pace = self._pace(sid)
            pace.started_at = pace.verified_at
            rate = pace.rate or self.rate
            if not greedy or tree.proposals or tree.size <= 1 or rate is None:
                return tree, None
            values = monotone_values(tree)
            accept = torch.sort(values[1:], descending=True).values.exp().tolist()
            n = self._choose(accept, rate, tree.size)
        if n == tree.size:
            return tree, None
        try:
            cut, keep = subtree(replace(tree, values=values, proposals=None), 0, n)
        except TreeError:          # not reached for a valid tree: the monotone values keep it connected
            return tree, None
        return cut, keep

    def verified(self, sid: str, nodes: int, seconds: float, committed: int) -> None:
        """A verify of ``nodes`` nodes for ``sid`` took ``seconds`` and committed
        ``committed`` tokens: it ends the session's cycle. A width's first verify
        is not timed (it may have opened its compiled graph); one verify moves
        an average at most to ``SPIKE`` times what it was (a noisy neighbour's
        stall is not the verifier's cost)."""
        now = time.perf_counter()
        with self.lock:
            width = width_of(nodes)
            self.verifies += 1
            if width in self.warmed:
                self.costs[width] = averaged(self.costs.get(width), seconds)
                self.timed_at[width] = self.verifies
            self.warmed.add(width)
            pace = self.sessions.get(sid)
            if pace is None:
                return
            if pace.started_at is not None:       # a whole cycle: from the last verify's end to this one's
                pace.tokens = averaged(pace.tokens, committed)
                pace.seconds = averaged(pace.seconds, now - pace.started_at)
                self.rate = averaged(self.rate, pace.rate)
            pace.verified_at = now

    def forget(self, sid: str) -> None:
        with self.lock:
            self.sessions.pop(sid, None)

    def snapshot(self) -> dict:
        """The measured verify costs (ms per width) and the sessions' averaged rate, for reports."""
        with self.lock:
            return {"verify_ms": {w: round(s * 1e3, 3) for w, s in sorted(self.costs.items())},
                    "tokens_per_s": None if self.rate is None else round(self.rate, 1)}

    # -- under the lock ----------------------------------------------------------------
    def _pace(self, sid: str) -> Pace:
        pace = self.sessions.get(sid)
        if pace is None:
            pace = self.sessions[sid] = Pace()
            while len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
        self.sessions.move_to_end(sid)
        return pace

    def _choose(self, accept: list[float], rate: float, cap: int) -> int:
        """The size to verify: a width never timed (the largest first), then one
        not timed for ``EXPLORE_EVERY`` verifies, else ``best_size``."""
        sizes = sizes_up_to(cap)
        untimed = [n for n in sizes if width_of(n) not in self.costs]
        if untimed:
            return untimed[-1]
        stale = min(sizes, key=lambda n: self.timed_at[width_of(n)])
        if self.verifies - self.timed_at[width_of(stale)] >= EXPLORE_EVERY:
            return stale
        return best_size(accept, self.costs, rate, cap)
