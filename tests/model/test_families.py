"""Every family of the matrix (``families.FAMILIES``): loads with the attention
implementation chosen for it, vanilla decoding equals transformers' own
``generate``, and every method, with a draft LM that is a copy of the target
and with the n-gram drafter, is token-identical to vanilla. The copy's trees
hold the target's own greedy continuation (for EAGLE-2 once its node values
are sharpened): every cycle accepts it to the full depth. Sliding windows both wider and narrower than prompt + new tokens
are in the matrix (``mistral-wide``, ``mistral-narrow`` and the hybrids)."""

import pytest
import torch
from families import FAMILIES, NARROW

from specdec.local import DrafterChoice, build_local, generate
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams

NEW = 20
GREEDY = SamplingParams()
METHODS = ("eagle2", "chain", "static")


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for n in (5, 9):
        body = torch.randint(1, vocab, (n,), generator=gen).tolist()
        out.append(body + body[:4])            # a repeat: the n-gram drafter finds matches
    return out


DEPTH = 4


def tree(method: str, value_temperature: float | None = None) -> TreeParams:
    return TreeParams(method=method, total_tokens=10, depth=DEPTH, expand_k=3, value_temperature=value_temperature)


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda f: f.name)
def stacks(request, family_dir):
    path = str(family_dir(request.param))
    spec = ModelSpec(path)
    copy = build_local(spec, DrafterChoice("draft-lm", path))
    return request.param, copy, build_local(spec, DrafterChoice("ngram"))


def test_vanilla_equals_transformers_generate(stacks):
    family, stack, _ = stacks
    model = stack.verifier.target.model
    for prompt in prompts(stack.verifier.target.vocab_size):
        assert len(prompt) + NEW > NARROW            # the narrow windows are shorter than the sequence
        want = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                              pad_token_id=0)[0, len(prompt):].tolist()
        got = generate(stack.verifier, None, prompt, GREEDY, StopCriteria(max_new_tokens=NEW), None).tokens
        assert got == want, f"{family.name}: vanilla differs from transformers' generate"


@pytest.mark.parametrize("method", METHODS)
def test_every_method_identical_to_vanilla(stacks, method):
    family, copy, ngram = stacks
    stop = StopCriteria(max_new_tokens=NEW)
    for prompt in prompts(copy.verifier.target.vocab_size):
        want = generate(copy.verifier, None, prompt, GREEDY, stop, None).tokens
        for name, stack in (("draft-lm copy", copy), ("ngram", ngram)):
            got = generate(stack.verifier, stack.drafter, prompt, GREEDY, stop, tree(method))
            assert got.tokens == want, f"{family.name}/{name}/{method} diverged on {prompt}"
        if method == "static":
            continue
        # the copy drafts the target's greedy path to the full depth: DEPTH + 1 tokens every cycle
        got = generate(copy.verifier, copy.drafter, prompt, GREEDY, stop, tree(method, value_temperature=0.05))
        assert got.tokens == want
        assert got.stats.cycles == -(-(NEW - 1) // (DEPTH + 1))
        assert got.stats.accepted == NEW - 1 - got.stats.cycles
    assert len(copy.verifier.sessions) == 0 and len(copy.drafter.sessions) == 0
