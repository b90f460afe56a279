"""specdec.request.decoding.SpeculationGate: drafting pauses while recent drafted
cycles commit too few tokens, deterministically, from token counts alone; a
paced gate (greedy sessions) also measures the break-even from cycle times."""

import pytest

from specdec.request.decoding import SpeculationGate
from specdec.request.pace import Pace


def run(gate, committed_when_drafting, cycles, seconds=(None, None)):
    """Drive the gate: a drafted cycle commits the next count, a paused one 1 token;
    ``seconds``: (a drafted cycle's, a root-only one's) wall time. Returns the
    pattern of drafted (True) / paused (False) cycles."""
    pattern, counts = [], iter(committed_when_drafting)
    for _ in range(cycles):
        drafted = gate.speculate()
        pattern.append(drafted)
        gate.record(drafted, next(counts) if drafted else 1, seconds[0] if drafted else seconds[1])
    return pattern


def test_off_always_drafts():
    assert run(SpeculationGate(0.0), [1] * 50, 50) == [True] * 50


def test_good_sessions_never_pause():
    gate = SpeculationGate(2.0)
    assert run(gate, [2, 3, 2, 4] * 20, 80) == [True] * 80
    assert gate.paused_cycles == 0


def test_low_tau_pauses_and_the_pause_doubles_until_max():
    gate = SpeculationGate(2.0, window=4, max_pause=16)
    pattern = run(gate, [1] * 100, 4 + 4 + 4 + 8 + 4 + 16 + 4 + 16 + 1)
    # 4 drafted to fill the window, pause 4, a fresh window of 4, pause 8, ..., pause 16 (the cap), ...
    expected = ([True] * 4 + [False] * 4 + [True] * 4 + [False] * 8 + [True] * 4 + [False] * 16
                + [True] * 4 + [False] * 16 + [True])
    assert pattern == expected
    assert gate.paused_cycles == 4 + 8 + 16 + 16


def test_recovery_resets_the_pause_length():
    gate = SpeculationGate(2.0, window=2)
    # two bad cycles -> pause 2; a fresh window (5, 4) has mean 4.5 >= 2: drafting goes on
    assert run(gate, [1, 1, 5, 4, 4, 1, 1], 9) == [True, True, False, False, True, True, True, True, True]
    assert gate.pause_len == 4                       # doubled after the last bad pair, from the reset 2


def test_a_pause_is_judged_on_fresh_cycles_only():
    """The bad cycles that caused a pause do not count against the cycles after
    it: a window of (3, 2) after a pause keeps drafting even though the window
    before it averaged 1."""
    gate = SpeculationGate(2.0, window=2)
    assert run(gate, [1, 1, 3, 2, 2, 2], 8) == [True, True, False, False, True, True, True, True]
    assert gate.paused_cycles == 2


def test_noisy_good_sessions_mostly_draft():
    """A session whose drafted cycles commit 2.4 tokens on average, spread
    widely, keeps drafting most of the time under a threshold of 2."""
    import random

    rng = random.Random(0)
    counts = []
    for _ in range(5000):
        t = 1
        while t <= 6 and rng.random() < 0.6:
            t += 1
        counts.append(t)
    pattern = run(SpeculationGate(2.0), counts, 5000)
    assert sum(pattern) / len(pattern) > 0.5


def test_same_counts_same_decisions():
    counts = [1, 2, 1, 1, 3, 1, 1, 1, 4, 4, 4, 1] * 5
    assert run(SpeculationGate(2.0), counts, 60) == run(SpeculationGate(2.0), counts, 60)


def test_negative_threshold_is_refused():
    with pytest.raises(ValueError, match="min_tau"):
        SpeculationGate(-1.0)


def test_a_paced_gate_keeps_a_session_paused_where_drafting_costs_more_than_it_commits():
    """Drafted cycles commit 3 tokens but take four plain cycles' time: the
    count alone (threshold 2) drafts on; paced, once a pause has timed the plain
    cycles, the break-even is 4 and the session stays paused but for its probes."""
    def gate(paced):
        g = SpeculationGate(2.0, window=4, max_pause=16)
        g.paced = paced
        g.recent.extend([1, 1, 1])                    # a poor start: the first window pauses
        return g

    counted = run(gate(False), [3] * 100, 100, (0.04, 0.01))
    paced_gate = gate(True)
    paced = run(paced_gate, [3] * 100, 100, (0.04, 0.01))
    assert counted[0] and not any(counted[1:5]) and all(counted[5:])      # paused once, then drafts on
    assert paced_gate.threshold == pytest.approx(4.0)
    assert sum(paced) < 25 and paced_gate.paused_cycles > 75


def test_a_paced_gate_keeps_drafting_where_drafting_pays():
    gate = SpeculationGate(2.0, window=4)
    gate.paced = True
    gate.recent.extend([1, 1, 1])
    pattern = run(gate, [3] * 100, 100, (0.02, 0.01))   # break-even 2: 3 tokens a drafted cycle pay
    assert gate.threshold == pytest.approx(2.0)
    assert sum(pattern) == 96


def test_an_unpaced_gate_ignores_the_clock():
    """Sampled sessions: decisions from the counts alone, whatever the times."""
    counts = [1, 2, 1, 1, 3, 1, 1, 1, 4, 4, 4, 1] * 5
    gate = SpeculationGate(2.0)
    pattern = run(gate, counts, 60, (0.5, 0.001))
    assert gate.threshold == 2.0
    assert pattern == run(SpeculationGate(2.0), counts, 60)


def losing_pace(pause=16):
    """A pair's pace after sessions whose drafted cycles committed 3 tokens in four plain cycles' time."""
    first = SpeculationGate(2.0, window=4, max_pause=64)
    first.paced = True
    first.share(Pace())
    first.recent.extend([1, 1, 1])
    run(first, [3] * 200, 200, (0.04, 0.01))
    first.pace.pause = pause
    return first.pace


def test_a_session_joining_a_losing_pair_starts_paused_for_the_pairs_last_pause():
    pace = losing_pace(pause=16)
    assert pace.losing(2.0) and pace.break_even == pytest.approx(4.0)
    gate = SpeculationGate(2.0, window=4, max_pause=64)
    gate.paced = True
    gate.share(pace)
    pattern = run(gate, [3] * 120, 120, (0.04, 0.01))
    # paused 16, a probe window of 4 (3 < 4: lost one plain cycle's time each), then paused for as
    # long as makes that loss 5% of the pause: 4 * (4 - 3) / 0.05 = 80 cycles, then a probe again
    assert pattern == [False] * 16 + [True] * 4 + [False] * 80 + [True] * 4 + [False] * 16
    assert pace.pause == 80                           # the pair now pauses its next sessions longer


def test_a_session_joining_a_paying_pair_drafts_at_once_and_a_good_prompt_wins_its_cycles_back():
    pace = losing_pace()
    paying = SpeculationGate(2.0)
    paying.paced = True
    paying.share(Pace())
    run(paying, [3] * 40, 40, (0.02, 0.01))            # nothing timed for the root-only kind: no break-even
    assert not paying.pace.losing(2.0)
    fresh = SpeculationGate(2.0)
    fresh.paced = True
    fresh.share(paying.pace)
    assert fresh.speculate()
    # a prompt the head drafts far better than the pair's mean: after the first pause it drafts on
    good = SpeculationGate(2.0, window=4)
    good.paced = True
    good.share(pace)
    pattern = run(good, [6] * 200, 200, (0.04, 0.01))
    assert not any(pattern[:16]) and all(pattern[16:])


def test_a_sampled_session_neither_reads_nor_writes_the_pairs_pace():
    """Unpaced (sampled) gates keep their own: a seeded request's cycles never
    depend on the sessions before it."""
    pace = losing_pace()
    before = (dict(pace.seconds), pace.tokens, pace.pause)
    gate = SpeculationGate(2.0)
    gate.share(pace)                                   # not paced: ignored
    counts = [1, 2, 1, 1, 3, 1, 1, 1, 4, 4, 4, 1] * 5
    assert run(gate, counts, 60, (0.5, 0.001)) == run(SpeculationGate(2.0), counts, 60)
    assert (dict(pace.seconds), pace.tokens, pace.pause) == before


def test_a_gate_that_is_off_ignores_the_pairs_pace():
    gate = SpeculationGate(0.0)
    gate.paced = True
    gate.share(losing_pace())
    assert run(gate, [1] * 20, 20) == [True] * 20


def test_with_an_auto_threshold_the_measured_break_even_decides_alone():
    """``--min-tau auto`` (``prior``): 2.0 stands in until the break-even is
    measured; drafted cycles of 1.8 tokens costing 1.3 plain ones pay, so once
    both are timed the session drafts on; with an explicit 2.0 (a floor) it
    stays paused but for its probes."""
    def gate(prior):
        g = SpeculationGate(2.0, window=4, max_pause=16, prior=prior)
        g.paced = True
        return g

    prior, floor = gate(True), gate(False)
    counts = [2, 2, 1, 2] * 50                      # mean 1.75 a drafted cycle
    auto = run(prior, counts, 200, (0.013, 0.01))
    fixed = run(floor, counts, 200, (0.013, 0.01))
    assert not all(auto[4:8])                       # the first window (below 2.0) paused both
    assert prior.threshold == pytest.approx(1.3) and floor.threshold == 2.0
    assert all(auto[8:]) and sum(fixed[8:]) <= len(fixed[8:]) // 4     # windows of 4 between pauses of 8–16


def rate(pattern, counts, seconds):
    """Tokens a second of a run's ``pattern``: a drafted cycle commits its count in
    ``seconds[0]``, a root-only one commits 1 in ``seconds[1]``."""
    tokens = sum(c if d else 1 for d, c in zip(pattern, counts))
    return tokens / sum(seconds[0] if d else seconds[1] for d in pattern)


@pytest.mark.parametrize("cost, tau, share", [(6.0, 2.5, 0.93), (4.0, 3.0, 0.93), (12.0, 3.0, 0.93),
                                             (1.5, 2.5, 0.99)])
def test_a_pairs_gate_costs_it_a_few_percent_of_its_best_rate(cost, tau, share):
    """Drafted cycles costing ``cost`` plain ones and committing ``tau`` tokens
    (SmolLM2 at int8 on a CPU: a 16-node cycle ~6 steps, tau ~2.5): over a
    long greedy run the paced gate keeps within ~7% of the better of plain
    decoding and drafting every cycle, its first windows and its root-only
    timings included (with pauses that only doubled, up to 64 cycles, and no
    root-only cycle ever timed while tau cleared 2, a losing pair ran at
    25-75% of plain decoding's rate); where drafting pays (1.5 steps for 2.5
    tokens) the root-only timings cost under 1%."""
    gate = SpeculationGate(2.0, window=4, max_pause=64)
    gate.paced = True
    counts = [tau] * 4000
    seconds = (0.01 * cost, 0.01)
    pattern = run(gate, counts, 4000, seconds)
    assert rate(pattern, counts, seconds) >= share * 100.0 * max(1.0, tau / cost)


def test_a_window_that_loses_less_than_its_pause_can_repay_keeps_the_doubling():
    """Drafted cycles just below the break-even (1.9 tokens at a cost of 2): the
    window's loss asks for 8 cycles, less than the doubling's, which decides."""
    gate = SpeculationGate(2.0, window=4, max_pause=16, prior=True)
    gate.paced = True
    gate.recent.extend([1, 1, 1])
    counts = [2, 2, 2, 1.6] * 50
    pattern = run(gate, counts, 60, (0.02, 0.01))
    assert gate.cost_pause(1.9) == 8
    # a window of 4, paused 4 (nothing timed yet), a window, paused 8, a window, paused 16
    assert pattern[:1] == [True] and pattern[1:5] == [False] * 4
    assert pattern[5:9] == [True] * 4 and pattern[9:17] == [False] * 8
    assert pattern[17:21] == [True] * 4 and pattern[21:37] == [False] * 16


def test_a_paced_session_that_never_pauses_still_times_root_only_cycles():
    """τ 2.5 clears ``min_tau`` 2 in every window, so nothing would ever time a
    plain cycle: after 4 drafted cycles one root-only cycle runs (a pair's
    first of a kind is not timed: it may have built a graph), after 4 more a
    second, the break-even (6) is known and the session pauses; where drafting
    pays (a drafted cycle 1.5 plain ones) it then costs one root-only cycle in 256."""
    losing = SpeculationGate(2.0, window=4)
    losing.paced = True
    pattern = run(losing, [2.5] * 30, 30, (0.06, 0.01))
    assert pattern[:10] == ([True] * 4 + [False]) * 2
    assert losing.threshold == pytest.approx(6.0)
    # the next drafted cycle judges the last four against 6: paused for 4 * (6 - 2.5) / 0.05 cycles
    assert pattern[10] and not any(pattern[11:]) and losing.pause_left == 280 - 19
    paying = SpeculationGate(2.0, window=4)
    paying.paced = True
    pattern = run(paying, [2.5] * 1000, 1000, (0.015, 0.01))
    assert [i for i, drafted in enumerate(pattern) if not drafted] == [4, 9, 266, 523, 780]
    assert paying.paused_cycles == 0


def test_a_slow_cycle_moves_the_pairs_break_even_by_a_bounded_step():
    """A drafted cycle 100 times the usual (a graph built mid-run) counts as 3
    times: the break-even moves by half, not fiftyfold, so the pauses it sizes
    stay bounded."""
    pace = Pace()
    for _ in range(8):                                # (the first of each kind is not timed)
        pace.record(True, 2, 0.02)
        pace.record(False, 1, 0.01)
    pace.record(True, 2, 2.0)
    assert pace.break_even == pytest.approx(2.0 * (1 + 0.25 * 2))
