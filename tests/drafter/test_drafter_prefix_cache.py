"""The drafters' prefix caches (``CachedTreeDrafter.prefill_prefix``): an EAGLE
head's block is keyed by its inputs (f_i, x_{i+1}), so the block ending at
position k needs tokens up to k, not k - 1; a hit (exact) loads the very K/V
a fresh feed computes; the draft LM's blocks are keyed by its tokens; the
n-gram drafter keeps nothing."""

import pytest
import torch

from serving.helpers import drafter_builder
from specdec.model.loading import ModelSpec
from specdec.model.prefix_cache import EXACT_BLOCK_TOKENS as B
from specdec.request.params import SamplingParams, TreeParams
from verifier.engine import TargetModel, VerifierEngine

CFG = TreeParams(method="eagle2", total_tokens=10, depth=4, expand_k=3)


@pytest.fixture(scope="module")
def verifier(tiny_family):
    return VerifierEngine(TargetModel(ModelSpec(str(tiny_family["target"]))), prefix_cache_tokens=16 * B,
                          prefix_cache_exact=True)


def prefilled(verifier, prompt):
    """(prompt + first token, the prompt's features), as the orchestrator hands them to a drafter."""
    result = verifier.prefill("v", prompt, SamplingParams())
    verifier.release("v")
    return prompt + [result.token], result.features


def keys_of(drafter, sid):
    return [layer.keys for layer in drafter.sessions.get(sid).cache.layers]


def same_state(a, b, sid) -> bool:
    """Two drafters hold the same K/V and root output for ``sid``, bit for bit."""
    sa, sb = a.sessions.get(sid), b.sessions.get(sid)
    return (all(torch.equal(x, y) for x, y in zip(keys_of(a, sid), keys_of(b, sid)))
            and torch.equal(sa.root_out[1], sb.root_out[1]))


def test_an_eagle_block_needs_the_token_after_it(tiny_family, verifier):
    cached, fresh = (drafter_builder(tiny_family, "eagle", prefix_cache_tokens=16 * B, prefix_cache_exact=True)()
                     for _ in range(2))
    vocab = verifier.target.vocab_size
    a = torch.randint(1, vocab, (2 * B + 5,), generator=torch.Generator().manual_seed(1)).tolist()
    b = a[:B] + [a[B] % (vocab - 1) + 1] + a[B + 1:]       # same tokens before position B, another at B
    tokens_a, feats_a = prefilled(verifier, a)
    tokens_b, feats_b = prefilled(verifier, b)
    assert torch.equal(feats_a[:B], feats_b[:B])           # a key over tokens < B and features would match
    cached.prefill("a", tokens_a, feats_a)
    cached.prefill("b", tokens_b, feats_b)
    fresh.prefill("b", tokens_b, feats_b)
    assert cached.prefix.stats.hits == 0                   # block 0 reads x_B, which differs
    assert same_state(cached, fresh, "b")
    # a's block 0 would have been wrong for b: the head's K/V at position B - 1 reads x_B
    assert not torch.equal(keys_of(cached, "a")[0][:, :, B - 1], keys_of(fresh, "b")[0][:, :, B - 1])
    c = a[:B + 1] + [a[B + 1] % (vocab - 1) + 1] + a[B + 2:]   # differs after x_B: block 0 is a's
    tokens_c, feats_c = prefilled(verifier, c)
    cached.prefill("c", tokens_c, feats_c)
    fresh.prefill("c", tokens_c, feats_c)
    assert cached.prefix.stats.hits == 1 and cached.prefix.stats.saved_tokens == B
    assert same_state(cached, fresh, "c")
    assert cached.draft("c", CFG).token_list == fresh.draft("c", CFG).token_list
    for sid in "abc":
        cached.release(sid)
    assert len(cached.sessions) == 0 and len(cached.prefix) == 5     # two blocks each, one of c's is a's


def test_an_eagle_block_keys_the_features_it_read(tiny_family, verifier):
    drafter = drafter_builder(tiny_family, "eagle", prefix_cache_tokens=16 * B)()
    prompt = torch.randint(1, verifier.target.vocab_size, (B + 5,), generator=torch.Generator().manual_seed(2))
    tokens, feats = prefilled(verifier, prompt.tolist())
    drafter.prefill("a", tokens, feats)
    drafter.prefill("b", tokens, feats + 1e-3)             # another target's features: no hit
    drafter.prefill("c", tokens, feats, cache_salt="other tenant")
    assert drafter.prefix.stats.hits == 0
    drafter.prefill("d", tokens, feats)
    assert drafter.prefix.stats.hits == 1


def test_the_draft_lm_hits_with_the_same_bits(tiny_family, verifier):
    cached, fresh = (drafter_builder(tiny_family, "draft-lm", prefix_cache_tokens=16 * B, prefix_cache_exact=True)()
                     for _ in range(2))
    prompt = torch.randint(1, verifier.target.vocab_size, (2 * B + 3,), generator=torch.Generator().manual_seed(3))
    tokens = prompt.tolist() + [5]
    cached.prefill("a", tokens)
    cached.rollback("a", B // 2)                           # the open session's later life never reaches its blocks
    cached.prefill("b", tokens)
    fresh.prefill("b", tokens)
    assert cached.prefix.stats.saved_tokens == 2 * B
    assert same_state(cached, fresh, "b")
    assert cached.draft("b", CFG).token_list == fresh.draft("b", CFG).token_list


def test_the_ngram_drafter_keeps_nothing(tiny_family):
    drafter = drafter_builder(tiny_family, "ngram", prefix_cache_tokens=16 * B)()
    drafter.prefill("a", list(range(1, 3 * B)))
    assert not drafter.prefix.on and drafter.prefix.stats.lookups == 0
