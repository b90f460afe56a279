"""Compiled draft levels of EAGLE-3 heads (``drafter.compiled.head_levels``): with a
reduced draft vocabulary (log-probs placed at their target ids, -inf
elsewhere), a compiled drafter drafts the eager drafter's trees, alone and in
a batch with other sessions."""

import random

import torch
from trees import assert_same_tree

from specdec.request.params import SamplingParams, TreeParams
from drafter.batch import draft_batch
from drafter.compiled import head_levels
from drafter.eagle.eagle3 import Eagle3Drafter

CONFIGS = [TreeParams(total_tokens=16, depth=6, expand_k=4), TreeParams(total_tokens=10, depth=3, expand_k=8),
           TreeParams(method="chain", total_tokens=6, depth=5)]


def test_compiled_eagle3_levels_draft_the_eager_trees(family3):
    head = "eagle3"                      # a reduced draft vocabulary: -inf outside it
    fast = Eagle3Drafter(family3[head], family3["target"], compile="on")
    assert fast.compiled is not None
    eager = Eagle3Drafter(family3[head], family3["target"])
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)

    def tokens(n):
        return [rng.randrange(eager.vocab_size) for _ in range(n)]

    def features(n):                     # the target's 3 layers, as the verifier sends them
        return torch.randn(n, fast.feature_size, generator=gen)

    sids = ["greedy", "sampled", "long"]
    for i, (sid, n) in enumerate(zip(sids, (6, 9, 40))):
        toks, feats = tokens(n), features(n - 1)
        sampling = SamplingParams(0.9, seed=i) if sid == "sampled" else None
        for d in (fast, eager):
            d.prefill(sid, toks, feats, greedy=sampling is None, sampling=sampling)
    for cycle in range(4):
        items = []
        for j, sid in enumerate(sids):
            n = rng.randrange(1, 5)
            items.append((sid, tokens(n), features(n), CONFIGS[(cycle + j) % len(CONFIGS)]))
        got = draft_batch(fast, items) if cycle == 3 else None       # the last cycle batched
        for k, (sid, toks, feats, cfg) in enumerate(items):
            eager.commit(sid, toks, feats)
            want = eager.draft(sid, cfg)
            if got is None:
                fast.commit(sid, toks, feats)
                assert_same_tree(fast.draft(sid, cfg), want)
            else:
                assert_same_tree(got[k], want)


def test_levels_over_the_heads_own_weights_give_the_eager_ones(family3):
    """The packages a GPU drafter builds (no packed copy: the head's weights and
    its vocabulary map, bound by name at load) pass the check at load."""
    drafter = Eagle3Drafter(family3["eagle3"], family3["target"])
    compiled = head_levels.CompiledHead(drafter, packed=False)
    assert not compiled.steps.packed and set(drafter.step_tensors()) <= set(compiled.steps.weights)
    assert head_levels.check_head(compiled) is None
