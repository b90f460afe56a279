"""specdec.request.pace: the greedy sessions of one verifier–drafter pair share
what their cycles cost; a new session on a pair where drafting loses starts
paused, with output unchanged; sampled sessions are never affected."""

import gc

import pytest

from specdec.local import PACES, DrafterChoice, build_local, generate
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.pace import Pace, Paces, knobs_key
from specdec.request.params import SamplingParams, TreeParams

TREE = TreeParams(total_tokens=10, depth=4, expand_k=3)
STOP = StopCriteria(max_new_tokens=12)
PROMPT = [5, 9, 13, 7, 5, 9, 13]


class Engine:
    """A stand-in for an in-process engine: any object that can be weakly referenced."""


def test_one_pace_per_key_the_least_recently_used_forgotten_first():
    paces = Paces(max_pairs=2)
    a = paces.of("v:1", "d:1", *knobs_key(TREE))
    assert paces.of("v:1", "d:1", *knobs_key(TREE)) is a
    assert paces.of("v:1", "d:2", *knobs_key(TREE)) is not a
    assert paces.of("v:1", "d:1", *knobs_key(TreeParams(total_tokens=32))) is not a     # another tree size
    assert len(paces) == 2
    assert paces.of("v:1", "d:1", *knobs_key(TREE)) is not a      # evicted: a fresh one


def test_sessions_drafting_ahead_or_under_a_budget_keep_their_own_pace():
    # a hit cycle costs a verify alone and a fresh one commits less: an ahead
    # session's figures must not pause a plain session on the same pair
    paces = Paces()
    plain = paces.of("v:1", "d:1", *knobs_key(TREE))
    assert paces.of("v:1", "d:1", *knobs_key(TREE, lookahead=4)) is not plain
    assert paces.of("v:1", "d:1", *knobs_key(TREE, verify_token_budget=64)) is not plain
    assert paces.of("v:1", "d:1", *knobs_key(TREE, lookahead=0, verify_token_budget=0)) is plain


def test_an_in_process_pairs_pace_is_forgotten_with_its_engines():
    paces = Paces()
    verifier, drafter = Engine(), Engine()
    pace = paces.of_objects((verifier, drafter), "eagle2")
    assert paces.of_objects((verifier, drafter), "eagle2") is pace
    other = Engine()
    assert paces.of_objects((verifier, other), "eagle2") is not pace
    assert len(paces) == 2
    del drafter
    gc.collect()
    assert len(paces) == 1                         # the pair of the collected drafter is forgotten
    del verifier
    gc.collect()
    assert len(paces) == 0


def test_a_pace_is_losing_only_once_both_kinds_of_cycle_were_timed():
    pace = Pace()
    pace.record(True, 2, 0.5)                      # a pair's first cycle of a kind is not timed (a graph build)
    pace.record(True, 2, 0.04)
    assert pace.break_even is None and not pace.losing(2.0)
    pace.record(False, 1, 0.3)
    assert pace.break_even is None
    pace.record(False, 1, 0.01)
    assert pace.break_even == pytest.approx(4.0) and pace.losing(2.0)
    pace.record(True, 3, 0.0)                      # untimed: the time is kept, the tokens counted
    assert pace.break_even == pytest.approx(4.0) and pace.tokens > 2


@pytest.fixture(scope="module")
def stack(tiny_family):
    return build_local(ModelSpec(str(tiny_family["target"])), DrafterChoice("eagle", str(tiny_family["eagle"])))


def seed_losing(stack):
    """The in-process pair's pace as if sessions before had drafted at a loss."""
    pace = PACES.of_objects((stack.verifier, stack.drafter), *knobs_key(TREE))
    pace.seconds, pace.tokens, pace.pause = {True: 0.04, False: 0.01}, 1.5, 32
    return pace


def test_a_greedy_session_on_a_losing_pair_starts_paused_with_the_same_output(stack):
    plain = generate(stack.verifier, None, PROMPT, SamplingParams(), STOP, None)
    alone = generate(stack.verifier, stack.drafter, PROMPT, SamplingParams(), STOP, TREE, min_tau=1.5)
    assert alone.stats.drafted > 0
    seed_losing(stack)
    joined = generate(stack.verifier, stack.drafter, PROMPT, SamplingParams(), STOP, TREE, min_tau=1.5)
    assert joined.tokens == alone.tokens == plain.tokens
    assert joined.stats.drafted == 0 and joined.gate.paused_cycles == joined.stats.cycles > 0


def test_a_sampled_session_drafts_the_same_cycles_whatever_the_pair_measured(stack):
    sampled = SamplingParams(temperature=1.0, seed=3)
    before = generate(stack.verifier, stack.drafter, PROMPT, sampled, STOP, TREE, min_tau=1.5)
    pace = seed_losing(stack)
    after = generate(stack.verifier, stack.drafter, PROMPT, sampled, STOP, TREE, min_tau=1.5)
    assert after.tokens == before.tokens
    assert after.stats.committed_per_cycle == before.stats.committed_per_cycle and after.stats.drafted > 0
    assert (pace.tokens, pace.pause) == (1.5, 32)


def test_an_auto_threshold_joins_a_pair_at_its_measured_break_even():
    """A pair whose drafted cycles commit 1.5 tokens at a break-even of 1.2 pays:
    a session with ``--min-tau auto`` (a prior) drafts at once; one with an
    explicit 2.0 (a floor) starts paused."""
    pace = Pace()
    pace.seconds, pace.tokens, pace.pause = {True: 0.012, False: 0.01}, 1.5, 16
    assert not pace.losing(2.0, prior=True) and pace.losing(2.0)
    assert pace.threshold(2.0, prior=True) == pytest.approx(1.2) and pace.threshold(2.0) == 2.0
