"""Bookkeeping of one generation: committed tokens, stop conditions, statistics.

Pure Python (no torch): the speculative loop (``specdec.request.speculative``), run
in-process and by the orchestrator, drives a ``Decoding`` with what the
verifier commits, so stop rules and the figures reported are the same code. Vocabulary: per cycle the verifier *accepts* some draft tokens and adds
one *bonus* token (the target's own choice at the last accepted node);
tau = mean tokens committed per draft/verify cycle, bonus included (vLLM's
"mean acceptance length"). Vanilla decoding has tau = 1.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from specdec.request.pace import Pace

PROBE_LOSS = 0.05       # paced: the most a losing window of drafted cycles may cost, as a share of the pause after it
MAX_COST_PAUSE = 1024   # paced: the longest pause a window's measured loss may ask for


@dataclass(frozen=True)
class StopCriteria:
    max_new_tokens: int = 128          # 0: the prompt only (a prefill scores it, nothing is generated)
    eos_ids: frozenset[int] = frozenset()
    # Called with all generated tokens; returns how many to keep when a stop
    # string completed (the orchestrator's detokenizer implements it), else None.
    stop_check: Callable[[list[int]], int | None] | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")


@dataclass
class DecodeStats:
    cycles: int = 0
    drafted: int = 0                              # draft tokens proposed (tree nodes minus roots)
    accepted: int = 0                             # draft tokens accepted
    committed_per_cycle: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: cycles with >= j+1 accepted
    # prefill: the verifier's prefill; commit: the drafter's; network: transport (gRPC)
    time_s: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "draft": 0.0, "verify": 0.0,
                                                               "commit": 0.0, "network": 0.0})
    ttft_s: float = 0.0
    wall_s: float = 0.0
    ahead_hits: int = 0                           # cycles whose tree was drafted one round ahead
    ahead_committed: int = 0                      # tokens those cycles committed (bonus included)

    @property
    def tau(self) -> float:
        return sum(self.committed_per_cycle) / self.cycles if self.cycles else 0.0

    def record_cycle(self, tree_size: int, accepted: int) -> None:
        self.cycles += 1
        self.drafted += max(0, tree_size - 1)
        self.accepted += accepted
        self.committed_per_cycle.append(accepted + 1)
        if len(self.accepted_per_position) < accepted:
            self.accepted_per_position.extend([0] * (accepted - len(self.accepted_per_position)))
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    def as_dict(self) -> dict:
        return {"cycles": self.cycles, "tau": round(self.tau, 4), "draft_tokens": self.drafted,
                "accepted_tokens": self.accepted, "accepted_per_position": list(self.accepted_per_position),
                "ahead_hits": self.ahead_hits, "ahead_committed": self.ahead_committed,
                "time_split_s": {k: round(v, 6) for k, v in self.time_s.items()},
                "ttft_s": round(self.ttft_s, 6), "wall_s": round(self.wall_s, 6)}


class SpeculationGate:
    """Drafting pays only while a drafted cycle commits more tokens than the
    plain cycles its time would buy: below ``min_tau`` (the break-even τ of
    the deployment's draft + verify cost against a one-token step) the
    session pauses drafting and runs root-only cycles.

    Deterministic by default: it looks at committed-token counts only, never at
    clocks, so a seeded request gives the same output every run and in-process
    and through the services. The mean over the last ``window`` drafted cycles
    decides; a pause lasts ``window`` cycles and doubles while the session
    keeps failing (up to ``max_pause``); after a pause a fresh window of
    drafted cycles decides again. (Judging a single new cycle together with
    the stale ones that caused the pause keeps a session whose τ is noisy
    paused far more than its mean deserves: simulated with sampled τ of mean
    2.4 and a threshold of 2, it drafted 17% of cycles instead of 59%.) ``min_tau`` 0:
    always draft. Output is unchanged either way: a root-only cycle is plain
    decoding.

    *Paced* (``paced``, set for greedy sessions, whose output never depends on
    which cycles draft): the break-even τ is also measured, as the session's
    drafted cycle time over its root-only cycle time (averages of the cycles'
    ``seconds``), and the threshold is the larger of it and ``min_tau``. Where
    a 16-node verify costs four one-token steps (int4 weights on a CPU) a
    fixed ``min_tau`` of 2 keeps drafting at a loss; paced, the first pause
    times the plain cycles and the session stays paused, probing a window of
    drafted cycles now and then. A paced pause is also long enough that the
    window which caused it cost at most ``PROBE_LOSS`` of the pause's time
    (``cost_pause``): where a drafted cycle costs six plain ones and commits
    2.5 tokens, a window of 4 loses 14 plain cycles' time, so the pause is 280
    cycles, not the 64 of the doubling alone, which (with the root-only
    timing below) cost SmolLM2 at int8 29% of plain decoding's rate. A
    session that never pauses still times a root-only cycle now and then
    (``Pace.root_due``), so the break-even is measured wherever drafting runs. With ``prior`` (``--min-tau auto``)
    ``min_tau`` only stands in until the break-even is measured, which then
    decides alone: in bf16 or on a GPU a 16-node cycle costs ~1.2–1.5 one-token
    steps, and windows committing 1.5–2 tokens still pay. The times and the mean τ live in a
    ``specdec.request.pace.Pace``: the gate's own, or one a verifier–drafter
    pair's paced sessions share (``share``)."""

    def __init__(self, min_tau: float = 0.0, window: int = 4, max_pause: int = 64, prior: bool = False):
        if not min_tau >= 0:
            raise ValueError(f"min_tau must be >= 0 (0 = always draft), got {min_tau}")
        self.min_tau = float(min_tau)
        # ``min_tau`` is a prior (``--min-tau auto``): paced, the measured break-even replaces it
        self.prior = prior
        self.recent: deque[int] = deque(maxlen=window)
        self.pause_len = window
        self.max_pause = max_pause
        self.pause_left = 0
        self.paused_cycles = 0
        self.paced = False
        self.pace = Pace()          # cycle times and τ (paced); a pair's shared one after ``share``

    def speculate(self) -> bool:
        """Whether the next cycle drafts: not while paused, nor (paced) when the
        pair's root-only cycles are due to be timed (``Pace.root_due``)."""
        if self.min_tau <= 0:
            return True
        return self.pause_left == 0 and not (self.paced and self.pace.root_due())

    @property
    def threshold(self) -> float:
        """The τ a window of drafted cycles must reach: ``min_tau``, or paced the
        measured break-even where it is higher."""
        return self.pace.threshold(self.min_tau, self.prior) if self.paced else self.min_tau

    def share(self, pace: Pace) -> None:
        """Time a paced session's cycles into ``pace``, its verifier–drafter pair's
        (``specdec.request.pace``); joining a pair whose drafted cycles have been
        committing below the threshold, start paused for the pair's last pause.
        An unpaced gate keeps its own: its decisions never depend on other sessions."""
        if not self.paced or self.min_tau <= 0:
            return
        self.pace = pace
        if pace.losing(self.min_tau, self.prior):
            self.pause(max(pace.pause, self.recent.maxlen))

    def pause(self, cycles: int) -> None:
        """Pause for ``cycles`` (at most ``max_pause``, or paced ``MAX_COST_PAUSE``
        where that is longer); the next pause is twice as long, up to ``max_pause``."""
        self.pause_left = min(cycles, max(self.max_pause, MAX_COST_PAUSE) if self.paced else self.max_pause)
        self.pause_len = min(2 * self.pause_left, self.max_pause)
        self.recent.clear()
        if self.paced:
            self.pace.pause = self.pause_left

    def record(self, drafted: bool, committed: int, seconds: float | None = None) -> None:
        """One cycle: whether it drafted (a tree beyond the root), the tokens it
        committed, and (paced) its wall time."""
        if self.min_tau <= 0:
            return
        if self.paced:
            self.pace.record(drafted, committed, seconds)
        if not drafted:
            if self.pause_left > 0:
                self.pause_left -= 1
                self.paused_cycles += 1
            return
        self.recent.append(committed)
        if len(self.recent) < self.recent.maxlen:
            return
        tokens = sum(self.recent) / len(self.recent)
        if tokens < self.threshold:
            self.pause(max(self.pause_len, self.cost_pause(tokens)))
        else:
            self.pause_len = self.recent.maxlen

    def cost_pause(self, tokens: float) -> int:
        """Paced: the root-only cycles after a window of drafted cycles that
        committed ``tokens`` each that make the window's loss at most
        ``PROBE_LOSS`` of their time. A drafted cycle of d seconds committing
        τ tokens loses d − τ·r against root-only cycles of r seconds, so a
        window of W loses W·r·(break-even − τ): the pause is W·(break-even −
        τ) / PROBE_LOSS cycles (0 unpaced, unmeasured, or not losing time)."""
        break_even = self.pace.break_even if self.paced else None
        if break_even is None or break_even <= tokens:
            return 0
        return math.ceil(round(self.recent.maxlen * (break_even - tokens) / PROBE_LOSS, 6))


class Decoding:
    """Committed output of one request; decides when to stop (and, through
    ``gate``, whether the next cycle drafts)."""

    def __init__(self, stop: StopCriteria, min_tau: float = 0.0, prior: bool = False):
        self.stop = stop
        self.gate = SpeculationGate(min_tau, prior=prior)
        self.tokens: list[int] = []
        self.logprobs: list = []       # one ``specdec.tree.sampling.TokenLogprob`` per token, when asked for
        self.prompt_logprobs: list = []   # one per prompt token but the first, when asked for
        self.stats = DecodeStats()
        # nothing to generate: done before the prefill's first token, which is never added
        self.finish_reason: str | None = None if stop.max_new_tokens else "length"
        self._t0 = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, new_tokens: list[int], logprobs: list | None = None) -> list[int]:
        """Append tokens committed by prefill or a cycle (with their logprobs,
        when asked for); returns the ones the caller may emit (cut at EOS,
        max_new_tokens or a stop string)."""
        if self.done:
            return []
        if not self.tokens:
            self.stats.ttft_s = time.perf_counter() - self._t0
        start = len(self.tokens)
        for tok in new_tokens:
            self.tokens.append(tok)
            if tok in self.stop.eos_ids:
                self.finish_reason = "eos"
                break
            if len(self.tokens) >= self.stop.max_new_tokens:
                self.finish_reason = "length"
                break
        if logprobs:
            self.logprobs.extend(logprobs[:len(self.tokens) - start])
        if self.stop.stop_check is not None:
            keep = self.stop.stop_check(self.tokens)
            if keep is not None:
                del self.tokens[keep:]
                del self.logprobs[keep:]
                self.finish_reason = "stop"
        self.stats.wall_s = time.perf_counter() - self._t0
        return self.tokens[start:]

    def finish(self) -> DecodeStats:
        self.stats.wall_s = time.perf_counter() - self._t0
        return self.stats
