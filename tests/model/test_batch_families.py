"""Batched verification and batched drafting (padded batch caches, one forward
for several sessions) on the families whose masks are not plain causal:
narrow sliding windows, hybrid sliding/full stacks, soft-capped attention,
multi-query attention, learned positions and ALiBi (each row's keys biased
by its own positions). Every session gets the tokens it gets alone."""

import random

import pytest
import torch
from families import BY_NAME

from specdec.local import DrafterChoice, build_local, generate
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from specdec.request.speculative import cycle_tree
from drafter.batch import draft_batch
from verifier.batch import verify_batch

NEW = 20
CFGS = [TreeParams(total_tokens=10, depth=4, expand_k=3), TreeParams(method="chain", depth=3),
        TreeParams(method="static", total_tokens=6, depth=3), TreeParams(total_tokens=4, depth=2, expand_k=2)]


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(9)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (3, 11, 7, 16)]


@pytest.mark.parametrize("name", ["mistral-narrow", "qwen2-sliding", "gemma2", "gemma3", "falcon", "gpt2",
                                  "falcon-alibi", "bloom", "mpt"])
def test_batched_sessions_get_the_tokens_they_get_alone(name, family_dir):
    path = str(family_dir(BY_NAME[name]))
    stack = build_local(ModelSpec(path), DrafterChoice("draft-lm", path))
    v, d = stack.verifier, stack.drafter
    ps = prompts(v.target.vocab_size)
    want = [generate(v, None, p, SamplingParams(), StopCriteria(max_new_tokens=NEW), None).tokens for p in ps]
    rng = random.Random(0)
    sids = [f"s{i}" for i in range(len(ps))]
    out = {sid: [] for sid in sids}
    pending = {sid: [] for sid in sids}
    for sid, p in zip(sids, ps):
        first = v.prefill(sid, p, SamplingParams(), NEW)
        d.prefill(sid, p + [first.token], greedy=True)
        out[sid].append(first.token)
    active = list(sids)
    while active:
        rng.shuffle(active)
        batch = active[:rng.randint(2, len(active))] if len(active) > 1 else active
        items = [(sid, pending[sid], None, cycle_tree(CFGS[sids.index(sid)], NEW - len(out[sid])))
                 for sid in batch]
        trees = draft_batch(d, items)
        results = verify_batch(v, [(sid, tree) for sid, tree in zip(batch, trees)])
        for sid, res in zip(batch, results):
            assert not isinstance(res, Exception), res
            out[sid].extend(res.tokens)
            pending[sid] = list(res.tokens)
            if len(out[sid]) >= NEW:
                active.remove(sid)
    for sid, w in zip(sids, want):
        assert out[sid][:NEW] == w, f"{name}: session {sid} differs from its solo run"
