"""What a verifier–drafter pair's cycles cost, shared by its greedy sessions.

A paced speculation gate (``specdec.request.decoding.SpeculationGate``) judges
drafting against the measured break-even τ: a drafted cycle's wall time over a
root-only cycle's. Learnt per session, every request pays to learn it again —
its first window of drafted cycles and its probes — and a 96-token request on
a pair where drafting loses spends a third of its cycles finding that out. The
cost is a property of the pair (the target, the head, the devices, the load),
not of one request, so the sessions of one pair time their cycles into one
``Pace``, and a new session on a pair whose drafted cycles have been committing
less than their break-even starts paused, for the pair's last pause (it still
probes after it: a prompt the head drafts well wins its cycles back).

Only greedy sessions read or write a pair's pace: their output never depends on
which cycles draft. Sampled sessions keep a count-only gate, so a seeded
request reproduces its cycles.

``Paces`` keeps one ``Pace`` per pair key: in process the two engine objects
(dropped when either is collected), in the services the replicas' addresses;
with the tree's method and size (``knobs_key``), which change both sides of the
break-even.
Pure Python, no torch.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Hashable

PACE_SMOOTHING = 0.25        # weight of the newest cycle in the mean cycle times
TOKENS_SMOOTHING = 0.05      # weight of the newest drafted cycle in the pair's mean τ (the last ~20 cycles)
MAX_PAIRS = 1024             # pairs remembered by one ``Paces`` (the least recently used go first)
SPIKE = 3.0                  # a cycle's time counts as at most this many times the mean it updates
ROOT_TIMING = (4, 256)       # drafted cycles after which a paced session times a root-only one: never timed, since


class Pace:
    """Mean wall seconds of a drafted and of a root-only cycle, the mean tokens a
    drafted cycle committed, and the last pause a gate on this pace began."""

    def __init__(self) -> None:
        self.seconds: dict[bool, float | None] = {True: None, False: None}
        self.tokens: float | None = None
        self.pause = 0
        self.drafted_since_root = 0     # drafted cycles recorded since the last root-only one
        self.timed = {True: 0, False: 0}   # cycles of each kind offered to the means

    def root_due(self) -> bool:
        """Whether the next cycle should be root-only to time one: after the
        first ``ROOT_TIMING[0]`` drafted cycles while none was ever timed,
        then every ``ROOT_TIMING[1]``. A session that never pauses would
        otherwise never measure the break-even, and keep drafting where its τ
        clears ``min_tau`` but not the time a drafted cycle costs (τ 2.5 from
        16-node cycles that cost six plain ones, int8 weights on a CPU)."""
        return self.drafted_since_root >= ROOT_TIMING[self.seconds[False] is not None]

    def record(self, drafted: bool, committed: int, seconds: float | None) -> None:
        """One cycle of a paced session: ``seconds`` None or 0 is not timed (a
        drafted tree cut to its root is neither kind of cycle). The gate's pauses
        grow with the break-even, so one slow cycle must not blow it up: a
        pair's first cycle of each kind is not counted (it may have opened or
        built a compiled graph), and a later one slower than ``SPIKE`` times
        its kind's mean (a graph built mid-run, a stall) counts as ``SPIKE`` times."""
        if seconds is not None and seconds > 0:
            self.timed[drafted] += 1
            mean = self.seconds[drafted]
            if self.timed[drafted] > 1:
                self.seconds[drafted] = smoothed(mean, seconds if mean is None else min(seconds, SPIKE * mean),
                                                 PACE_SMOOTHING)
        if drafted:
            self.tokens = smoothed(self.tokens, committed, TOKENS_SMOOTHING)
            self.drafted_since_root += 1
        else:
            self.drafted_since_root = 0

    @property
    def break_even(self) -> float | None:
        """The τ at which a drafted cycle pays its time; None until both kinds were timed."""
        drafted, plain = self.seconds[True], self.seconds[False]
        if drafted is None or plain is None or plain <= 0:
            return None
        return drafted / plain

    def threshold(self, min_tau: float, prior: bool = False) -> float:
        """The τ drafting must reach: the larger of ``min_tau`` and the break-even,
        or (``prior``: ``min_tau`` was only a default) the break-even once measured."""
        break_even = self.break_even
        if break_even is None:
            return min_tau
        return break_even if prior else max(min_tau, break_even)

    def losing(self, min_tau: float, prior: bool = False) -> bool:
        """Drafted cycles have been committing less than the threshold, both measured."""
        if self.tokens is None or self.break_even is None:
            return False
        return self.tokens < self.threshold(min_tau, prior)


def knobs_key(tree, lookahead: int = 0, verify_token_budget: int = 0) -> tuple:
    """The part of a pair's key that changes what its cycles cost and commit: a
    tree's (``TreeParams``) method and size, the outcomes drafted ahead (a hit
    cycle costs a verify alone) and the verify budget (which cuts trees).
    Sessions that differ in any of them never share a pace: a pair's ahead
    sessions would otherwise pass their cheaper cycles and their fresh trees'
    lower τ to the plain ones, and pause them."""
    return (tree.method, tree.total_tokens, tree.depth, tree.expand_k, tree.proposals,
            int(lookahead), int(verify_token_budget))


def smoothed(mean: float | None, value: float, weight: float) -> float:
    return float(value) if mean is None else mean + weight * (value - mean)


class Paces:
    """One ``Pace`` per verifier–drafter pair."""

    def __init__(self, max_pairs: int = MAX_PAIRS) -> None:
        self.table: OrderedDict[Hashable, Pace] = OrderedDict()
        self.max_pairs = max_pairs

    def of(self, *key: Hashable) -> Pace:
        """The pace of the pair named by ``key`` (e.g. the replicas' addresses)."""
        pace = self.table.get(key)
        if pace is None:
            pace = self.table[key] = Pace()
            while len(self.table) > self.max_pairs:
                self.table.popitem(last=False)
        else:
            self.table.move_to_end(key)
        return pace

    def of_objects(self, objects: tuple[object, ...], *rest: Hashable) -> Pace:
        """The pace of the pair of live ``objects`` (in-process engines) and ``rest``,
        forgotten once any of the objects is collected, so a new object at a reused
        id starts afresh."""
        key = ("objects",) + tuple(id(o) for o in objects) + rest
        if key not in self.table:
            for o in objects:
                weakref.finalize(o, self.table.pop, key, None)
        return self.of(*key)

    def __len__(self) -> int:
        return len(self.table)
