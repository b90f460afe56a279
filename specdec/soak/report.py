"""What a soak found: figures, the verdict, and both renderings (text and JSON).

A soak fails (``SoakReport.failures`` not empty, exit status 1) on any of:
an unexpected outcome, a greedy output that differs from its reference (or a
reference that differs from plain decoding), a session still open on a
backend after the load, a process that died without being killed, or a
surviving process whose RSS grew by more than the threshold.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field

from specdec.soak.load import Outcome

VERDICTS = ("ok", "cancelled", "deadline", "expected", "unexpected")
EXAMPLES = 10                      # unexpected outcomes / mismatches listed in full


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) by the nearest-rank method; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[rank]


@dataclass
class ProcessMemory:
    name: str
    start_mb: float                 # RSS once the load began (or once it was restarted)
    end_mb: float                   # RSS after the load
    restarted: bool                 # killed during the soak: not held to the growth threshold

    @property
    def growth(self) -> float:
        return (self.end_mb - self.start_mb) / self.start_mb if self.start_mb > 0 else 0.0


@dataclass
class SoakReport:
    settings: dict
    load_s: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    reference_disagreements: list[dict] = field(default_factory=list)
    kills: list[dict] = field(default_factory=list)
    open_sessions: dict[str, int] = field(default_factory=dict)
    memory: list[ProcessMemory] = field(default_factory=list)
    died: list[str] = field(default_factory=list)
    max_rss_growth: float = 0.10

    # -- figures --------------------------------------------------------------------------
    def by_verdict(self) -> dict[str, int]:
        counts = Counter(o.verdict for o in self.outcomes)
        return {v: counts.get(v, 0) for v in VERDICTS}

    def by_kind(self) -> dict[str, dict[str, int]]:
        table: dict[str, Counter] = {}
        for o in self.outcomes:
            table.setdefault(o.kind, Counter())[o.verdict] += 1
        return {kind: {v: c.get(v, 0) for v in VERDICTS} for kind, c in sorted(table.items())}

    def expected_codes(self) -> dict[str, int]:
        """{"KIND: CODE (while PROCESS was away)": count}"""
        return dict(Counter(f"{o.kind}: {o.code}" + (f" (while the {o.during} was away)" if o.during else "")
                            for o in self.outcomes if o.verdict == "expected"))

    def unexpected(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.verdict == "unexpected"]

    def mismatches(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.mismatch]

    def latency(self) -> dict[str, float]:
        done = [o.latency_s for o in self.outcomes if o.verdict == "ok" and o.kind != "malformed"]
        return {"requests": len(done), "p50_s": percentile(done, 0.5), "p99_s": percentile(done, 0.99)}

    def failures(self) -> list[str]:
        out = []
        if self.unexpected():
            out.append(f"{len(self.unexpected())} unexpected outcomes")
        if self.mismatches():
            out.append(f"{len(self.mismatches())} greedy outputs differ from their reference")
        if self.reference_disagreements:
            out.append(f"{len(self.reference_disagreements)} references differ from plain decoding")
        leaked = {name: n for name, n in self.open_sessions.items() if n != 0}
        if leaked:
            out.append("sessions left open: " + ", ".join(f"{name} {n}" for name, n in leaked.items()))
        if self.died:
            out.append("died without being killed: " + ", ".join(self.died))
        grown = [m for m in self.memory if not m.restarted and m.growth > self.max_rss_growth]
        if grown:
            out.append("RSS grew past {:.0%}: ".format(self.max_rss_growth)
                       + ", ".join(f"{m.name} {m.growth:+.1%}" for m in grown))
        if not any(o.verdict == "ok" for o in self.outcomes):
            out.append("no request succeeded")
        return out

    # -- renderings -----------------------------------------------------------------------
    def to_json(self) -> dict:
        def brief(o: Outcome) -> dict:
            return {"client": o.client, "kind": o.kind, "case": o.case, "code": o.code, "during": o.during,
                    "detail": o.detail[:300], "latency_s": round(o.latency_s, 4), "tokens": len(o.tokens)}

        return {
            "settings": self.settings, "load_s": round(self.load_s, 2), "requests": len(self.outcomes),
            "outcomes": self.by_verdict(), "by_kind": self.by_kind(), "expected_codes": self.expected_codes(),
            "unexpected": [brief(o) for o in self.unexpected()],
            "greedy_mismatches": [brief(o) for o in self.mismatches()],
            "reference_disagreements": self.reference_disagreements, "kills": self.kills,
            "open_sessions": self.open_sessions,
            "memory": [{**asdict(m), "growth": round(m.growth, 4)} for m in self.memory],
            "max_rss_growth": self.max_rss_growth, "died": self.died, "latency": self.latency(),
            "failures": self.failures(), "passed": not self.failures(),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    def text(self) -> str:
        verdicts = self.by_verdict()
        lines = [f"specdec soak: {len(self.outcomes)} requests in {self.load_s:.0f} s "
                 f"({self.settings.get('clients')} clients)",
                 "outcomes: " + ", ".join(f"{v} {n}" for v, n in verdicts.items())]
        width = max([len(k) for k in self.by_kind()] + [4])
        lines.append(f"  {'kind':<{width}}  " + "  ".join(f"{v:>10}" for v in VERDICTS))
        for kind, row in self.by_kind().items():
            lines.append(f"  {kind:<{width}}  " + "  ".join(f"{row[v]:>10}" for v in VERDICTS))
        if self.expected_codes():
            lines.append("expected error codes:")
            lines += [f"  {k}: {n}" for k, n in sorted(self.expected_codes().items())]
        lat = self.latency()
        lines.append(f"latency of {lat['requests']} completed requests: p50 {lat['p50_s'] * 1e3:.0f} ms, "
                     f"p99 {lat['p99_s'] * 1e3:.0f} ms")
        for o in self.unexpected()[:EXAMPLES]:
            lines.append(f"  UNEXPECTED {o.kind} [{o.case[:40]}]: {o.code} {o.detail[:160]}")
        lines.append(f"greedy outputs differing from their reference: {len(self.mismatches())}")
        for o in self.mismatches()[:EXAMPLES]:
            lines.append(f"  MISMATCH {o.kind} prompt {o.case}: {len(o.tokens)} tokens ({o.code})")
        for d in self.reference_disagreements:
            lines.append(f"  REFERENCE prompt {d['prompt']}: speculative output differs from plain decoding")
        for k in self.kills:
            lines.append(f"kill: {k['name']} at {k['at_s']:.1f} s, back after {k['away_s']:.1f} s")
        lines.append("sessions open after the load: "
                     + (", ".join(f"{name} {n}" for name, n in self.open_sessions.items()) or "(no backend known)"))
        for m in self.memory:
            note = " (restarted)" if m.restarted else ""
            lines.append(f"RSS {m.name}{note}: {m.start_mb:.0f} -> {m.end_mb:.0f} MB ({m.growth:+.1%})")
        failures = self.failures()
        lines.append("FAILED: " + "; ".join(failures) if failures else "PASSED: nothing lost, nothing leaked")
        return "\n".join(lines)
