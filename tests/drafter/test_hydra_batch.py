"""Hydra heads in a ``draft_batch``: the first level of every session (the
prefix layer's feed of Hydra++ heads, then head 0 over each session's
feature and root) is one forward for the whole batch, and each session gets
exactly the tree it gets drafted alone, through commits, a rollback, a late
session and cycles that commit nothing; bad items fail alone."""

import pytest
import torch
from test_draft_batch import CONFIGS, PROMPT_LENGTHS, Sessions
from trees import assert_same_tree

from drafter.batch import draft_batch
from drafter.hydra import load_hydra_drafter
from drafter.hydra_heads import save_heads
from specdec.model import kv
from specdec.request.errors import NotFound
from specdec.request.params import SamplingParams
from tiny import tiny_hydra


@pytest.fixture(scope="module", params=["mlp", "prefix-mlp"])
def heads_dir(request, tiny_family, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_family["target"])
    path = tmp_path_factory.mktemp("hydra-batch") / request.param
    save_heads(tiny_hydra(target, seed=9, num_heads=4, num_layers=2, prefix=request.param == "prefix-mlp"), path)
    return path


def pair(tiny_family, heads_dir):
    drafters = [load_hydra_drafter(heads_dir, tiny_family["target"]) for _ in range(2)]
    for d in drafters:
        d.greedy_value_temperature = 0.7
    return drafters


def count_forwards(module) -> list:
    calls = []
    module.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("seed", [0, 1])
def test_batched_trees_equal_solo_trees(tiny_family, heads_dir, seed):
    drafter, reference = pair(tiny_family, heads_dir)
    s = Sessions(drafter, reference, seed)
    head0 = count_forwards(drafter.heads.hydra_lm_head[0])
    prefix = count_forwards(drafter.heads.prefix) if drafter.heads.prefix is not None else None
    sids = [f"s{i}" for i in range(len(PROMPT_LENGTHS))]
    drawn = 0
    for i, (sid, n) in enumerate(zip(sids, PROMPT_LENGTHS)):
        s.prefill(sid, n, greedy=i % 3 == 0, sampling=SamplingParams(0.9, seed=i) if i % 3 == 1 else None)
    for cycle in range(5):
        if cycle == 2:            # a fresh session (no prefix KV yet) joins sessions with long ones
            s.prefill("late", 5)
            sids.append("late")
        if cycle == 3:            # a rolled-back session feeds its root's hidden state again
            for d in (drafter, reference):
                d.rollback("s2", PROMPT_LENGTHS[2] - 3)
        items = []
        for sid in sids:
            tokens, feats = s.commit() if cycle != 4 else ([], None)
            items.append((sid, tokens, feats, s.rng.choice(CONFIGS)))
        s.rng.shuffle(items)
        head0.clear()
        if prefix is not None:
            prefix.clear()
        stale = any(tokens for _, tokens, _, _ in items) or any(drafter.sessions.get(i).state is None for i in sids)
        got = draft_batch(drafter, items)
        assert stale == (cycle != 4)
        # one head-0 call (and one prefix-layer forward) for the whole batch; none when nothing was committed
        assert len(head0) == int(stale)
        if prefix is not None:
            assert len(prefix) == int(stale)
        for (sid, tokens, feats, cfg), tree in zip(items, got):
            assert_same_tree(tree, s.want(sid, tokens, feats, cfg))
            drawn += bool(tree.proposals)
            sess = drafter.sessions.get(sid)
            if prefix is not None:         # the prefix KV holds the committed hidden states, all of them
                assert sess.fed == kv.seq_len(sess.cache) == len(sess.tokens) - 1
    assert drawn > 0
    for sid in sids:                       # and the sessions draft on alone as the reference does
        tokens, feats = s.commit()
        if tokens:
            drafter.commit(sid, tokens, feats)
        assert_same_tree(drafter.draft(sid, CONFIGS[0]), s.want(sid, tokens, feats, CONFIGS[0]))


def test_bad_items_fail_alone(tiny_family, heads_dir):
    drafter, reference = pair(tiny_family, heads_dir)
    s = Sessions(drafter, reference, 5)
    for sid, n in (("a", 9), ("b", 14)):
        s.prefill(sid, n)
    ok = s.commit()
    items = [("a", *ok, CONFIGS[0]), ("ghost", [], None, CONFIGS[0]), ("b", [4], torch.zeros(3, 48), CONFIGS[1])]
    got = draft_batch(drafter, items)
    assert_same_tree(got[0], s.want("a", *ok, CONFIGS[0]))
    assert isinstance(got[1], NotFound)
    assert "features of shape [1, " in str(got[2])
    assert_same_tree(drafter.draft("b", CONFIGS[1]), reference.draft("b", CONFIGS[1]))
