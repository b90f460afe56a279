"""Compiled draft levels of EAGLE heads (``drafter.compiled.head_levels``): the trees a
compiled drafter drafts are the eager drafter's (greedy and sampled
proposals, fed pairs included), generations stay token-identical to eager
vanilla, levels the graphs do not cover run eagerly, and a head that fails to
compile or to match its eager levels drafts eagerly with one log line."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from trees import assert_drafts_plain_greedy, assert_same_tree

from specdec.model import kv
from specdec.request.params import SamplingParams, TreeParams
from drafter.compiled import head_levels
from drafter.eagle.eagle2 import EagleDrafter

TREES = [TreeParams(total_tokens=16, depth=6, expand_k=4), TreeParams(total_tokens=10, depth=3, expand_k=8),
         TreeParams(method="chain", total_tokens=6, depth=5)]


@pytest.fixture(scope="module")
def heads(tiny_family):
    """(compiled drafter, eager drafter) over the tiny family's EAGLE head."""
    fast = EagleDrafter(tiny_family["eagle"], tiny_family["target"], compile="on")
    assert fast.compiled is not None
    return fast, EagleDrafter(tiny_family["eagle"], tiny_family["target"])


def feed(drafters, sid, rng, gen, n, sampling=None):
    tokens = [rng.randrange(drafters[0].vocab_size) for _ in range(n)]
    feats = torch.randn(n - 1, drafters[0].hidden_size, generator=gen)
    for d in drafters:
        d.prefill(sid, tokens, feats, greedy=sampling is None, sampling=sampling)


@pytest.mark.parametrize("sampled", [False, True])
def test_compiled_levels_draft_the_eager_trees(heads, sampled):
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    sampling = SamplingParams(temperature=0.9, seed=3) if sampled else None
    for i, prompt in enumerate((5, 30, 12)):
        sid = f"s{i}"
        feed(heads, sid, rng, gen, prompt, sampling)
        for cycle in range(4):
            cfg = TREES[(i + cycle) % len(TREES)]
            trees = [d.draft(sid, cfg) for d in heads]
            assert_same_tree(*trees)
            n = rng.randrange(1, 6)                      # a cycle's commit: fed through the compiled graphs
            tokens = [rng.randrange(heads[0].vocab_size) for _ in range(n)]
            feats = torch.randn(n, heads[0].hidden_size, generator=gen)
            for d in heads:
                d.commit(sid, tokens, feats)
        sess = heads[0].sessions.get(sid)
        assert kv.seq_len(sess.cache) == sess.fed
        assert head_levels.fixed_buffers(sess.cache) is not None      # still on the stacked buffer


def test_levels_past_the_graphs_run_eagerly(heads):
    fast, _ = heads
    cache = fast.compiled.new_cache()
    h = fast.hidden_size
    wide = max(head_levels.WIDTHS) + 1
    assert fast.compiled.step(cache, torch.zeros(wide, dtype=torch.long), torch.zeros(wide, h),
                              torch.arange(wide), torch.ones(wide, wide, dtype=torch.bool)) is None
    full = head_levels.HEAD_CAPACITY
    with torch.inference_mode():
        fast.head(fast.embed_tokens(torch.zeros(1, full - 1, dtype=torch.long)), torch.zeros(1, full - 1, h),
                  torch.arange(full - 1)[None], None, cache)
    assert fast.compiled.step(cache, torch.zeros(2, dtype=torch.long), torch.zeros(2, h), torch.full((2,), full),
                              torch.ones(2, full + 1, dtype=torch.bool)) is None


def test_generation_with_compiled_levels_is_plain_greedy_decoding(heads, tiny_family):
    assert_drafts_plain_greedy(heads[0], tiny_family["target"], TreeParams())


def test_a_batch_of_fresh_sessions_drafts_the_eager_trees(heads):
    """Sessions with empty caches batched together: the batch runs on an eager
    cache, not on a one-row stacked buffer (which cannot take the batch's rows)."""
    from drafter.batch import draft_batch

    rng, gen = random.Random(4), torch.Generator().manual_seed(4)
    cfg = TreeParams(total_tokens=8, depth=3, expand_k=2)
    for sid, n in (("fresh0", 5), ("fresh1", 8)):
        feed(heads, sid, rng, gen, n)
    items = [("fresh0", [], None, cfg), ("fresh1", [], None, cfg)]
    for got, want in zip(draft_batch(heads[0], items), draft_batch(heads[1], items)):
        assert_same_tree(got, want)


def test_failed_compilation_drafts_eagerly_with_one_line(tiny_family, caplog, monkeypatch):
    def broken(self, drafter, packed=True):
        raise RuntimeError("no C++ compiler\nsecond line")

    monkeypatch.setattr(head_levels.CompiledHead, "__init__", broken)
    with caplog.at_level(logging.WARNING, logger="drafter.compiled.head_levels"):
        drafter = EagleDrafter(tiny_family["eagle"], tiny_family["target"], compile="on")
    assert drafter.compiled is None
    lines = [r.getMessage() for r in caplog.records if r.name == "drafter.compiled.head_levels"]
    assert len(lines) == 1
    assert "RuntimeError: no C++ compiler" in lines[0] and "second line" not in lines[0]


def test_levels_that_differ_from_eager_ones_are_refused(tiny_family, caplog, monkeypatch):
    real = head_levels.CompiledHead.step

    def off_by_a_little(self, *args):
        got = real(self, *args)
        return None if got is None else (got[0], got[1] + 0.01)

    monkeypatch.setattr(head_levels.CompiledHead, "step", off_by_a_little)
    with caplog.at_level(logging.WARNING, logger="drafter.compiled.head_levels"):
        drafter = EagleDrafter(tiny_family["eagle"], tiny_family["target"], compile="on")
    assert drafter.compiled is None
    assert any("differ from eager ones" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("eager_ms, compiled_ms, kept", [(10.0, 5.0, True), (5.0, 10.0, False)])
def test_auto_keeps_compiled_levels_only_where_they_pay(tiny_family, monkeypatch, eager_ms, compiled_ms, kept):
    times = iter([eager_ms, compiled_ms])           # compile_head times eager first, then compiled
    monkeypatch.setattr(head_levels, "time_level", lambda *args, **kwargs: next(times))
    drafter = EagleDrafter(tiny_family["eagle"], tiny_family["target"], compile="auto")
    assert (drafter.compiled is not None) == kept


def test_off_is_eager_and_modes_are_checked(tiny_family):
    assert EagleDrafter(tiny_family["eagle"], tiny_family["target"]).compiled is None
    with pytest.raises(ValueError, match="compile must be one of"):
        EagleDrafter(tiny_family["eagle"], tiny_family["target"], compile="always")


def test_padded_mask_is_the_padded_additive_mask(heads):
    from specdec.model import masks
    from specdec.compile.fixed_kv import pad_mask

    fast, _ = heads
    gen = torch.Generator().manual_seed(0)
    for k, past, width in ((3, 5, 4), (1, 0, 1), (5, 20, 8), (8, 3, 8)):
        allowed = torch.rand(k, past + k, generator=gen) < 0.5
        want = pad_mask(masks.additive(allowed)[None, None], width, 64)
        assert torch.equal(fast.compiled.padded_mask(allowed, width, 64), want)


def test_a_batch_of_sessions_drafts_one_by_one_on_the_compiled_levels(heads, monkeypatch):
    from drafter import batch

    fast, eager = heads
    assert batch._model_for(fast) is None and batch._model_for(eager) is not None
    levels = []
    for name in ("step", "feed"):                  # tree levels, and the pairs fed before them
        run = getattr(fast.compiled, name)
        monkeypatch.setattr(fast.compiled, name, lambda *a, run=run, **k: levels.append(1) or run(*a, **k))
    rng, gen = random.Random(5), torch.Generator().manual_seed(5)
    sids = [f"batch-{i}" for i in range(3)]
    for sid, n in zip(sids, (7, 19, 11)):
        feed(heads, sid, rng, gen, n)
    trees = batch.draft_batch(fast, [(sid, [], None, TREES[0]) for sid in sids])
    assert levels                                                      # the compiled levels drafted them
    for sid, tree in zip(sids, trees):
        assert_same_tree(tree, eager.draft(sid, TREES[0]))



def test_levels_over_the_heads_own_weights_give_the_eager_ones(tiny_family):
    """The packages a GPU drafter builds (no packed copy: the head's weights and
    the target's tables it reads, bound by name at load) pass the check at load."""
    drafter = EagleDrafter(tiny_family["eagle"], tiny_family["target"])
    compiled = head_levels.CompiledHead(drafter, packed=False)
    assert not compiled.steps.packed and set(drafter.step_tensors()) <= set(compiled.steps.weights)
    assert head_levels.check_head(compiled) is None


@pytest.mark.parametrize("targets, heads, packed", [("off", "auto", True), ("off", "on", True),
                                                    ("on", "off", False), ("auto", "off", False)])
def test_heads_pack_by_their_own_switch(tiny_family, monkeypatch, targets, heads, packed):
    """``SPECDEC_COMPILE_PACKED_HEADS`` alone decides whether a head's levels take
    packed weights; ``SPECDEC_COMPILE_PACKED`` (the targets') does not."""
    asked = []

    def record(self, drafter, packed=True):
        asked.append(packed)
        raise RuntimeError("recorded")

    monkeypatch.setenv("SPECDEC_COMPILE_PACKED", targets)
    monkeypatch.setenv("SPECDEC_COMPILE_PACKED_HEADS", heads)
    monkeypatch.setattr(head_levels.CompiledHead, "__init__", record)
    assert EagleDrafter(tiny_family["eagle"], tiny_family["target"], compile="on").compiled is None
    assert asked == [packed]
