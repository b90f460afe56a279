"""EAGLE-3 under the prefix cache: the verifier's cached features are the
session's feature layers (part of the key), the head's blocks are keyed by the
rows it projected, and a hit leaves greedy output as plain decoding's."""

import torch

from specdec.local import DrafterChoice, build_local, generate
from specdec.model.loading import ModelSpec
from specdec.model.prefix_cache import EXACT_BLOCK_TOKENS as B
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams


def test_eagle3_hits_leave_greedy_output_as_plain_decoding(family3):
    spec, choice = ModelSpec(str(family3["target"])), DrafterChoice("eagle", str(family3["eagle3"]))
    stack = build_local(spec, choice, prefix_cache_tokens=16 * B, prefix_cache_exact=True)
    vocab = stack.verifier.target.vocab_size
    system = torch.randint(1, vocab, (B + 20,), generator=torch.Generator().manual_seed(5)).tolist()
    stop, cfg = StopCriteria(max_new_tokens=16), TreeParams(total_tokens=12, depth=4, expand_k=4)
    for tail in ([3, 4, 5], [6, 7], [3, 4, 5]):
        prompt = system + tail
        plain = generate(stack.verifier, None, prompt, SamplingParams(), stop, None)
        assert generate(stack.verifier, stack.drafter, prompt, SamplingParams(), stop, cfg).tokens == plain.tokens
    # plain decoding asks for no feature layers: its blocks (features: the final hidden state) are not
    # the EAGLE-3 sessions', whose first prefill misses
    assert stack.verifier.prefix.blocks.stats.hits == 2 + 2 and stack.drafter.prefix.stats.hits == 2
