"""How the soak judges outcomes and when its report fails (specdec.soak.load.judge,
specdec.soak.report), and the command's one-line errors."""

from __future__ import annotations

import pytest

from specdec.cli.main import main
from specdec.soak.load import Outcome, Window, judge
from specdec.soak.report import ProcessMemory, SoakReport, percentile

REFS = {0: [5, 6, 7, 8]}
KILL = Window("verifier", "verifier-1", start=10.0, end=15.0)


def outcome(kind, code, start=0.0, end=1.0, tokens=(), case="0"):
    return judge(Outcome(0, kind, case, code, "", start, end, list(tokens)), [KILL], REFS)


@pytest.mark.parametrize("kind,code,start,verdict", [
    ("greedy", "OK", 0, "ok"),
    ("greedy", "UNAVAILABLE", 0, "unexpected"),            # nothing was away
    ("greedy", "UNAVAILABLE", 14, "expected"),             # the verifier was
    ("greedy", "DEADLINE_EXCEEDED", 0, "unexpected"),      # no short deadline was asked for
    ("greedy", "INTERNAL", 14, "unexpected"),
    ("cancel", "CANCELLED", 0, "cancelled"),
    ("greedy-stream", "CANCELLED", 0, "unexpected"),
    ("deadline", "DEADLINE_EXCEEDED", 0, "deadline"),
    ("deadline", "OK", 0, "ok"),
    ("malformed", "INVALID_ARGUMENT", 0, "expected"),
    ("malformed", "OK", 0, "unexpected"),                  # accepted: a validation hole
    ("malformed", "RESOURCE_EXHAUSTED", 0, "unexpected"),
    ("malformed", "UNAVAILABLE", 12, "expected"),
])
def test_verdicts(kind, code, start, verdict):
    o = outcome(kind, code, start, start + 1, tokens=REFS[0] if code == "OK" and kind != "malformed" else ())
    assert o.verdict == verdict
    assert o.during == ("verifier-1" if 10 <= start + 1 and start <= 15 else "")


def test_greedy_outputs_are_checked_against_the_reference():
    assert not outcome("greedy", "OK", tokens=[5, 6, 7, 8]).mismatch
    assert outcome("greedy", "OK", tokens=[5, 6, 7, 9]).mismatch
    assert outcome("greedy-stream", "OK", tokens=[5, 6, 7]).mismatch          # a whole output, cut short
    assert not outcome("cancel", "CANCELLED", tokens=[5, 6]).mismatch         # a prefix is all a cancel gets
    assert outcome("cancel", "CANCELLED", tokens=[5, 7]).mismatch
    assert not outcome("sampled", "OK", tokens=[1, 2]).mismatch               # sampled outputs differ freely


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0 and percentile(values, 0.99) == 99.0 and percentile(values, 1.0) == 100.0
    assert percentile([], 0.5) == 0.0 and percentile([3.0], 0.99) == 3.0


def report(**kw) -> SoakReport:
    r = SoakReport(settings={"clients": 1}, load_s=1.0, outcomes=[outcome("greedy", "OK", tokens=REFS[0])],
                   open_sessions={"verifier": 0, "drafter": 0},
                   memory=[ProcessMemory("verifier", 100.0, 105.0, False)])
    for name, value in kw.items():
        setattr(r, name, value)
    return r


@pytest.mark.parametrize("change,failure", [
    ({}, None),
    ({"open_sessions": {"verifier": 2, "drafter": 0}}, "sessions left open: verifier 2"),
    ({"memory": [ProcessMemory("verifier", 100.0, 120.0, False)]}, "RSS grew past 10%: verifier +20.0%"),
    ({"memory": [ProcessMemory("verifier", 100.0, 120.0, True)]}, None),       # restarted: not held to it
    ({"died": ["drafter"]}, "died without being killed: drafter"),
    ({"outcomes": [outcome("greedy", "OK", tokens=[9])]}, "1 greedy outputs differ from their reference"),
    ({"outcomes": [outcome("malformed", "OK")]}, "1 unexpected outcomes"),
])
def test_failures(change, failure):
    r = report(**change)
    assert r.failures() == ([] if failure is None else [failure]) or failure in r.failures()
    text = r.text()
    assert text.splitlines()[-1].startswith("PASSED" if failure is None else "FAILED")
    assert r.to_json()["passed"] == (failure is None)


@pytest.mark.parametrize("argv,message", [
    (["--server", "127.0.0.1:9", "--kills", "drafter"], "--kills needs a stack the soak starts itself"),
    (["--kills", "drafter,gpu"], "unknown role 'gpu'"),
    (["--clients", "0"], "need clients >= 1"),
    (["--state", "x.json"], "--state goes with --server"),
    (["--server", "127.0.0.1:9", "--duration", "1"], "the reference of prompt 0 (vanilla) failed: UNAVAILABLE"),
])
def test_command_errors_are_one_line(argv, message, capsys):
    assert main(["soak", *argv]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]            # after the progress lines, if any
    assert last.startswith("specdec: error: ") and message in last and "Traceback" not in err


def test_soak_ports_are_outside_the_kernels_ephemeral_range():
    """Servers beside the soak bind port 0: a soak port picked there could be taken before a restart binds it."""
    from specdec.soak.stack import _ephemeral_range, free_port

    low, high = _ephemeral_range()
    ports = {free_port() for _ in range(50)}
    assert all(not low <= port <= high and port >= 1024 for port in ports)
    assert len(ports) > 1
