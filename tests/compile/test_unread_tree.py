"""A tree drafted on the device and verified before anyone reads it
(``specdec.tree.placed.DeviceTree``, an in-process run over a compiled target
and a whole-draft graph): the graph places it as the host would, the verifier
reads it once with its verdict, generations are unchanged (greedy: plain
greedy decoding; seeded sampling: the level path's very draws), and a draft
the graph flagged is thrown away for its level-by-level twin with nothing of
the first verify kept. Plain decoding's token stays on the device for the
next step's forward, and draws what the eager step draws."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from trees import assert_same_tree

from specdec.compile.forwards import width_bucket
from specdec.local import generate
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from specdec.tree.placed import DeviceTree, place_tree
from drafter.compiled import whole_draft
from drafter.compiled.whole_draft import use_budget
from drafter.eagle.eagle2 import EagleDrafter
from verifier.engine import TargetModel, VerifierEngine
from verifier.session import TargetSession

TREE = TreeParams(total_tokens=12, depth=4, proposals="top")
STOP = StopCriteria(max_new_tokens=24, eos_ids=frozenset())
PROMPTS = ([3, 17, 42, 9, 3, 17, 42], [5, 6, 7, 8, 5, 6, 9, 11])
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
PENALISED = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.4, seed=12)


@pytest.fixture(scope="module")
def stack(tiny_family):
    """(a compiled target, a drafter drafting TREE whole on the device, the same drafter level by level)."""
    target = VerifierEngine(TargetModel(ModelSpec(str(tiny_family["target"]), compile="on")))
    fast = EagleDrafter(tiny_family["eagle"], tiny_family["target"], compile="on")
    use_budget(fast, TREE)
    assert fast.compiled_tree is not None and fast.compiled_tree.serves(TREE, 0)
    levels = EagleDrafter(tiny_family["eagle"], tiny_family["target"], compile="on")
    levels.compiled_tree = None
    return target, fast, levels


def counting(monkeypatch, cls, name: str) -> list:
    """Calls of ``cls.name`` from now on, each one appended."""
    real, calls = getattr(cls, name), []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cls, name, counted)
    return calls


def test_the_graph_places_its_tree_as_the_host_would(stack):
    _, fast, _ = stack
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    tokens = [rng.randrange(fast.vocab_size) for _ in range(10)]
    fast.prefill("placed", tokens, torch.randn(9, fast.hidden_size, generator=gen), greedy=True)
    try:
        for depth in range(1, fast.compiled_tree.levels + 1):          # a request's last trees are shallower
            cfg = replace(TREE, depth=depth)
            unread = fast.draft("placed", cfg, deferred=True)
            assert isinstance(unread, DeviceTree)
            tree = unread.materialize()
            assert_same_tree(tree, fast.draft("placed", cfg))            # the draft read at once
            prefix = len(fast.sessions.get("placed").tokens) - 1
            want = place_tree(tree, prefix, width_bucket(tree.size), "cpu")
            assert unread.placed.n == tree.size and unread.placed.prefix_len == prefix
            assert torch.equal(unread.placed.packed, want.packed), depth
            fast.commit("placed", [rng.randrange(fast.vocab_size)], torch.randn(1, fast.hidden_size, generator=gen))
    finally:
        fast.release("placed")


def test_greedy_runs_read_the_draft_with_the_verdict_and_decode_plainly(stack, monkeypatch):
    target, fast, _ = stack
    reads = counting(monkeypatch, DeviceTree, "materialize")
    unread = counting(monkeypatch, TargetSession, "settle_unread")
    for prompt in PROMPTS:
        want = generate(target, None, prompt, SamplingParams(), STOP, None).tokens
        got = generate(target, fast, prompt, SamplingParams(), STOP, TREE)
        assert got.tokens == want and got.finish().drafted > 0
    assert len(unread) > 0 and reads == []         # no tree was read before its verdict


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_a_flagged_draft_is_verified_level_by_level_and_the_first_verify_leaves_nothing(stack, monkeypatch,
                                                                                        params):
    """Every draft flagged by the graph (as a tie would): the verifier throws its
    verify away (the cache back at the prefix, the draws undone) and verifies
    the level path's tree: the run is the level path's, draw for draw."""
    target, fast, levels = stack
    want = [generate(target, levels, p, params, STOP, TREE).tokens for p in PROMPTS]
    real, flagged = whole_draft.CompiledTree.draft, []

    def flagging(self, *args, **kwargs):
        got = real(self, *args, **kwargs)
        if got is not None and isinstance(got[0], DeviceTree):
            got[0].read[0] = 0.0
            flagged.append(1)
        return got

    monkeypatch.setattr(whole_draft.CompiledTree, "draft", flagging)
    thrown = counting(monkeypatch, TargetSession, "settle_unread")
    got = [generate(target, fast, p, params, STOP, TREE).tokens for p in PROMPTS]
    assert got == want
    assert len(flagged) == len(thrown) > 0


@pytest.mark.parametrize("params", [SAMPLED, PENALISED], ids=["sampled", "penalised"])
def test_sampled_runs_draw_what_the_level_path_draws(stack, params):
    """Seeded, over one-hot proposals: the same trees and the same draws whether
    the tree was read with the verdict (sampled) or first (penalised: its
    counts follow each node's path on the host)."""
    target, fast, levels = stack
    for prompt in PROMPTS:
        want = generate(target, levels, prompt, params, STOP, TREE).tokens
        assert generate(target, fast, prompt, params, STOP, TREE).tokens == want


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED, PENALISED], ids=["greedy", "sampled", "penalised"])
def test_plain_decoding_keeps_its_token_on_the_device_and_decodes_as_the_eager_step(stack, tiny_family, params):
    target = stack[0]
    eager = VerifierEngine(TargetModel(ModelSpec(str(tiny_family["target"]))))
    for prompt in PROMPTS:
        want = generate(eager, None, prompt, params, STOP, None).tokens
        assert generate(target, None, prompt, params, STOP, None).tokens == want


DRAWN_TREE = replace(TREE, proposals="sampled")
DRAWN = SamplingParams(temperature=0.8, seed=13)
DRAWN_PENALISED = SamplingParams(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.4, seed=14)


@pytest.mark.parametrize("params", [DRAWN, DRAWN_PENALISED], ids=["sampled", "penalised"])
def test_trees_of_drawn_proposals_are_verified_unread_and_draw_what_a_read_tree_draws(stack, monkeypatch, params):
    """Sampled proposals (``specdec.tree.drawn``): the tree drafted on the
    device is verified before anyone reads it, with its proposals on the
    device, and the run draws what it draws when each tree is read first and
    placed by the verifier (no filter cuts a proposal short here, so the trees
    have no dead nodes and the walks the same uniforms)."""
    target, fast, _ = stack
    reads = counting(monkeypatch, DeviceTree, "materialize")
    unread = counting(monkeypatch, TargetSession, "settle_unread")
    got = [generate(target, fast, p, params, STOP, DRAWN_TREE) for p in PROMPTS]
    assert len(unread) > 0 and reads == []
    assert all(g.finish().drafted > 0 for g in got)
    monkeypatch.setattr(VerifierEngine, "_verify_unread", lambda self, sess, tree: None)    # read first
    want = [generate(target, fast, p, params, STOP, DRAWN_TREE).tokens for p in PROMPTS]
    assert [g.tokens for g in got] == want and len(reads) > 0


@pytest.mark.parametrize("params, tree", [(SamplingParams(), TREE), (DRAWN, DRAWN_TREE), (SAMPLED, TREE)],
                         ids=["greedy", "drawn", "one-hot"])
def test_logprobs_come_back_with_the_verdict_and_equal_the_eager_ones(stack, tiny_family, params, tree):
    """Logprobs asked for: every node's are made on the device with the walk
    and read with its verdict, one read a cycle (``TargetSession.logprob_parts``);
    they are the eager engine's for the same tokens (the raw model's
    log-softmax and its top alternatives)."""
    from specdec.bench.cycle_profile import Tally, counting

    target, fast, _ = stack
    eager = VerifierEngine(TargetModel(ModelSpec(str(tiny_family["target"]))))
    for prompt in PROMPTS:
        tally = Tally()
        with counting(tally):
            got = generate(target, fast, prompt, params, STOP, tree, logprobs=3)
        cycles = got.finish().cycles
        assert len(got.logprobs) == len(got.tokens) > 0
        # the eager engine's logprobs of the same tokens: teacher-forced, one forward over the generation
        ids = prompt + got.tokens
        sess = eager.prefill("lp", ids, SamplingParams(), 1, prompt_logprobs=3)
        try:
            expect = sess.prompt_logprobs[len(prompt) - 1:]
        finally:
            eager.release("lp")
        assert len(expect) == len(got.logprobs)
        for g, w in zip(got.logprobs, expect):
            assert g.token == w.token and g.top_tokens == w.top_tokens
            assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
            assert g.top_logprobs == pytest.approx(w.top_logprobs, abs=1e-4)
        # one read a cycle, and the prefill's: its token, and its first token's logprobs read apart
        reads = sum(n for (kind, site), n in tally.phases["loop"].sites.items()
                    if kind == "reads" and site != "specdec/tree/sampling.py:token_logprobs")
        assert reads <= cycles + 1, [(k, n) for k, n in tally.phases["loop"].sites.items() if k[0] != "ops"]
