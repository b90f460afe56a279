"""A draft LM's compiled steps (``drafter.draft_lm`` over ``specdec.compile.forwards``):
the trees it drafts are the eager drafter's, greedy and sampled, through
commits and draft levels; its one-token steps and levels take the compiled
path; a session moves up the capacity buckets as it fills; generations stay
token-identical to vanilla; a draft LM that fails to compile drafts eagerly."""

from __future__ import annotations

import logging
import random

import pytest
from trees import assert_drafts_plain_greedy, assert_same_tree

from specdec.compile import fixed_kv, forwards
from specdec.model import kv
from specdec.model.loading import ModelSpec
from specdec.request.params import SamplingParams, TreeParams
from drafter.batch import draft_batch
from drafter.draft_lm import DraftLmDrafter

TREES = [TreeParams(total_tokens=16, depth=6, expand_k=4), TreeParams(method="chain", total_tokens=6, depth=5),
         TreeParams(total_tokens=10, depth=3, expand_k=8)]


@pytest.fixture(scope="module")
def drafters(tiny_family):
    """(compiled drafter, eager drafter) drafting with the tiny family's target
    (any causal LM drafts; its compiled packages are the target tests' own)."""
    spec = ModelSpec(str(tiny_family["target"]))
    fast = DraftLmDrafter(spec, compile="on")
    assert fast.compiled is not None
    return fast, DraftLmDrafter(spec)


@pytest.mark.parametrize("sampled", [False, True])
def test_compiled_steps_draft_the_eager_trees(drafters, sampled):
    rng = random.Random(1)
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=5) if sampled else None
    vocab = drafters[0].vocab_size
    for i, prompt in enumerate((4, 25, 9)):
        sid = f"{'s' if sampled else 'g'}{i}"
        tokens = [rng.randrange(vocab) for _ in range(prompt)]
        for d in drafters:
            d.prefill(sid, tokens, greedy=sampling is None, sampling=sampling)
        for cycle in range(4):
            cfg = TREES[(i + cycle) % len(TREES)]
            assert_same_tree(*(d.draft(sid, cfg) for d in drafters))
            commit = [rng.randrange(vocab) for _ in range(rng.randrange(1, 5))]
            for d in drafters:
                d.commit(sid, commit)
        sess = drafters[0].sessions.get(sid)
        assert fixed_kv.fixed_buffers(sess.cache) is not None      # still on the stacked buffer


def test_the_prompt_and_one_token_steps_take_the_compiled_path(drafters, monkeypatch):
    fast, _ = drafters
    calls = []
    real = forwards.CompiledForward.run

    def counted(self, cache, tokens, positions, mask, *args, **kwargs):
        out = real(self, cache, tokens, positions, mask, *args, **kwargs)
        calls.append((tokens.shape[1], out is not None))
        return out

    monkeypatch.setattr(forwards.CompiledForward, "run", counted)
    tree = TreeParams(total_tokens=8, depth=3, expand_k=2)
    fast.prefill("one", [1, 2, 3, 4, 5])
    fast.draft("one", tree)
    fast.commit("one", [6])
    fast.draft("one", tree)
    assert calls[0] == (5, True)                         # the prompt's feed: compiled too (``CompiledForward.prefill``)
    assert (1, True) in calls[1:]                        # the commit's one-token step
    assert all(ran for _, ran in calls[1:]) and len(calls) >= 6


def test_a_session_moves_up_the_capacity_buckets_as_it_fills(drafters):
    fast, _ = drafters
    small = forwards.capacity_bucket(0)
    rng = random.Random(2)
    tokens = [rng.randrange(fast.vocab_size) for _ in range(small - 6)]
    for d in drafters:
        d.prefill("long", tokens)
    for cycle in range(4):
        assert_same_tree(*(d.draft("long", TreeParams(total_tokens=8, depth=4, expand_k=2)) for d in drafters))
        commit = [rng.randrange(fast.vocab_size) for _ in range(3)]
        for d in drafters:
            d.commit("long", commit)
    sess = fast.sessions.get("long")
    assert kv.seq_len(sess.cache) > small
    fixed = fixed_kv.fixed_buffers(sess.cache)
    assert fixed is not None and fixed.stack.shape[4] == forwards.capacity_bucket(small + 1)


def test_batched_drafting_of_fresh_and_long_sessions_matches_eager(drafters):
    """A batch of sessions with empty caches (the batch cache is an eager one,
    not a one-row stacked buffer), then sessions crossing a capacity bucket
    through the batch's feed: the eager drafter's trees, and the compiled
    sessions stay on their stacked buffers."""
    fast, slow = drafters
    rng = random.Random(3)
    small = forwards.capacity_bucket(0)
    prompts = {"f0": 5, "f1": 9, "near": small - 4}
    for sid, n in prompts.items():
        tokens = [rng.randrange(fast.vocab_size) for _ in range(n)]
        for d in drafters:
            d.prefill(f"batch-{sid}", tokens)
    cfg = TreeParams(total_tokens=8, depth=3, expand_k=2)
    for cycle in range(3):
        items = []
        for sid in prompts:
            commit = [rng.randrange(fast.vocab_size) for _ in range(3)] if cycle else []
            items.append((f"batch-{sid}", commit, None, cfg))
        for got, want in zip(draft_batch(fast, items), draft_batch(slow, items)):
            assert_same_tree(got, want)
    for sid in prompts:
        assert fixed_kv.fixed_buffers(fast.sessions.get(f"batch-{sid}").cache) is not None
    crossed = fast.sessions.get("batch-near").cache
    assert kv.seq_len(crossed) > small and crossed.fixed_buffers.stack.shape[4] == forwards.capacity_bucket(small + 1)


def test_generation_with_a_compiled_draft_lm_is_plain_greedy_decoding(drafters, tiny_family):
    assert_drafts_plain_greedy(drafters[0], tiny_family["target"], TreeParams(total_tokens=8, depth=4))


def test_a_draft_lm_that_fails_to_compile_drafts_eagerly(tiny_family, caplog, monkeypatch):
    def broken(self, lm):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(forwards.CompiledForward, "__init__", broken)
    with caplog.at_level(logging.WARNING, logger="specdec.compile.startup"):
        drafter = DraftLmDrafter(ModelSpec(str(tiny_family["target"])), compile="on")
    assert drafter.compiled is None
    assert sum("RuntimeError: no C++ compiler" in r.getMessage() for r in caplog.records) == 1
    drafter.prefill("s", [1, 2, 3])
    assert drafter.draft("s", TreeParams(total_tokens=4, depth=2)).size >= 1


def test_the_spec_carries_compile_and_off_is_eager(tiny_family):
    path = str(tiny_family["target"])
    assert DraftLmDrafter(ModelSpec(path)).compiled is None
    assert DraftLmDrafter(ModelSpec(path, compile="on")).compiled is not None
    with pytest.raises(ValueError, match="compile must be one of"):
        DraftLmDrafter(ModelSpec(path), compile="always")
