"""specdec.decoding.SpeculationGate: drafting pauses while recent drafted
cycles commit too few tokens, deterministically, from token counts alone."""

import pytest

from specdec.decoding import SpeculationGate


def run(gate, committed_when_drafting, cycles):
    """Drive the gate: a drafted cycle commits the next count, a paused one 1 token.
    Returns the pattern of drafted (True) / paused (False) cycles."""
    pattern, counts = [], iter(committed_when_drafting)
    for _ in range(cycles):
        drafted = gate.speculate()
        pattern.append(drafted)
        gate.record(drafted, next(counts) if drafted else 1)
    return pattern


def test_off_always_drafts():
    assert run(SpeculationGate(0.0), [1] * 50, 50) == [True] * 50


def test_good_sessions_never_pause():
    gate = SpeculationGate(2.0)
    assert run(gate, [2, 3, 2, 4] * 20, 80) == [True] * 80
    assert gate.paused_cycles == 0


def test_low_tau_pauses_and_the_pause_doubles_until_max():
    gate = SpeculationGate(2.0, window=4, max_pause=16)
    pattern = run(gate, [1] * 100, 4 + 4 + 1 + 8 + 1 + 16 + 1 + 16 + 1)
    # 4 drafted to fill the window, pause 4, one drafted re-check, pause 8, re-check, pause 16 (the cap), ...
    expected = [True] * 4 + [False] * 4 + [True] + [False] * 8 + [True] + [False] * 16 + [True] + [False] * 16 + [True]
    assert pattern == expected
    assert gate.paused_cycles == 4 + 8 + 16 + 16


def test_recovery_resets_the_pause_length():
    gate = SpeculationGate(2.0, window=2)
    # two bad cycles -> pause 2; a re-check of 5 lifts the mean of (1, 5) to 3 >= 2: drafting resumes
    assert run(gate, [1, 1, 5, 4, 4, 1, 1], 9) == [True, True, False, False, True, True, True, True, True]
    assert gate.pause_len == 4                       # doubled after the last bad pair, from the reset 2


def test_same_counts_same_decisions():
    counts = [1, 2, 1, 1, 3, 1, 1, 1, 4, 4, 4, 1] * 5
    assert run(SpeculationGate(2.0), counts, 60) == run(SpeculationGate(2.0), counts, 60)


def test_negative_threshold_is_refused():
    with pytest.raises(ValueError, match="min_tau"):
        SpeculationGate(-1.0)
