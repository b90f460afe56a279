"""Batched drafting with EAGLE-3 heads (drafter.batch): sessions drafted
together in one ``draft_batch`` call get exactly the trees each gets alone —
the target's 3-layer features projected on arrival, the reduced draft
vocabulary mapped to target ids — one forward feeds every session and one
runs each tree level for all of them, and the sessions' caches keep only
committed inputs."""

import random

import pytest
import torch
from trees import assert_same_tree

from specdec.model import kv
from specdec.request.params import SamplingParams, TreeParams
from drafter.batch import draft_batch
from drafter.eagle.eagle3 import Eagle3Drafter

CONFIGS = [TreeParams(method="eagle2", total_tokens=12, depth=4, expand_k=3),
           TreeParams(method="eagle2", total_tokens=6, depth=2, expand_k=2),
           TreeParams(method="chain", total_tokens=6, depth=5),
           TreeParams(method="static", total_tokens=10, depth=3),
           TreeParams(method="eagle2", total_tokens=16, depth=6, expand_k=4)]
PROMPT_LENGTHS = (4, 11, 23, 7)


@pytest.mark.parametrize("head", ["eagle3", "eagle3-full"])
@pytest.mark.parametrize("seed", [0, 1])
def test_batched_eagle3_trees_equal_solo_trees(family3, head, seed):
    drafter, reference = (Eagle3Drafter(family3[head], family3["target"]) for _ in range(2))
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    in_vocab = reference.target_ids.tolist()        # tokens the draft vocabulary holds, and others

    def tokens(n):
        return [rng.choice(in_vocab) if rng.random() < 0.7 else rng.randrange(reference.vocab_size) for _ in range(n)]

    def features(n):                                # the target's 3 layers, as the verifier sends them
        return torch.randn(n, drafter.feature_size, generator=gen)

    sids = [f"s{i}" for i, _ in enumerate(PROMPT_LENGTHS)]
    for i, (sid, n) in enumerate(zip(sids, PROMPT_LENGTHS)):
        toks, feats = tokens(n), features(n - 1)
        sampling = SamplingParams(0.9, seed=i) if i % 2 else None
        for d in (drafter, reference):
            d.prefill(sid, toks, feats, greedy=i % 2 == 0, sampling=sampling)
    forwards = []
    drafter.head.register_forward_hook(lambda *_: forwards.append(1))
    for _ in range(4):
        items = []
        for sid in sids:
            n = rng.randrange(4)
            items.append((sid, tokens(n), features(n) if n else None, rng.choice(CONFIGS)))
        forwards.clear()
        got = draft_batch(drafter, items)
        levels = max(min(cfg.depth, cfg.total_tokens - 1) for *_, cfg in items)
        assert len(forwards) <= 1 + levels         # batched: not one forward per session and level
        for (sid, toks, feats, cfg), tree in zip(items, got):
            if toks:
                reference.commit(sid, toks, feats)
            assert_same_tree(tree, reference.draft(sid, cfg))
            assert set(tree.tokens.tolist()[1:]) <= set(in_vocab)
            sess = drafter.sessions.get(sid)
            assert kv.seq_len(sess.cache) == sess.fed == len(sess.tokens) - 1
