"""Medusa and Hydra heads (Hydra++ prefix-mlp ones too) where every drafter
goes: greedy output equals plain greedy decoding of the target with drafting
paused by the speculation gate, and on the compiled target, whose verifies hand the heads the last
hidden state of the compiled forwards (the heads themselves run eager),
and drafts from them are accepted."""

import pytest
import torch

from specdec.local import DrafterChoice, build_local, generate
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from tiny import save_tiny_heads

GREEDY = SamplingParams()
TREE = TreeParams(total_tokens=8, depth=3, expand_k=4)      # the compiled tests' widths: their packages serve
STOP = StopCriteria(max_new_tokens=32, eos_ids=frozenset())
KINDS = ["medusa", "hydra", "hydra-prefix"]


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(21)
    out = []
    for _ in range(4):
        body = torch.randint(1, vocab, (int(torch.randint(3, 16, (1,), generator=gen)),), generator=gen).tolist()
        out.append(body + body[: len(body) // 2])
    return out


@pytest.fixture(scope="module")
def heads(tiny_family, tmp_path_factory):
    return save_tiny_heads(tiny_family["target"], tmp_path_factory.mktemp("heads-everywhere"))


@pytest.fixture(scope="module")
def reference(tiny_family):
    stack = build_local(ModelSpec(str(tiny_family["target"])), DrafterChoice("none"))
    return [generate(stack.verifier, None, p, GREEDY, STOP, None).tokens
            for p in prompts(stack.verifier.target.vocab_size)]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_identical_with_drafting_paused_by_the_gate(tiny_family, heads, reference, kind):
    stack = build_local(ModelSpec(str(tiny_family["target"])), DrafterChoice(kind.removesuffix("-prefix"), str(heads[kind])))
    for prompt, want in zip(prompts(stack.verifier.target.vocab_size), reference):
        gated = generate(stack.verifier, stack.drafter, prompt, GREEDY, STOP, TREE, min_tau=100.0)
        free = generate(stack.verifier, stack.drafter, prompt, GREEDY, STOP, TREE)
        assert gated.tokens == free.tokens == want
        assert gated.stats.drafted < free.stats.drafted
    assert len(stack.verifier.sessions) == 0 and len(stack.drafter.sessions) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_identical_on_the_compiled_target(tiny_family, heads, reference, kind):
    stack = build_local(ModelSpec(str(tiny_family["target"]), compile="on"), DrafterChoice(kind.removesuffix("-prefix"), str(heads[kind])))
    assert stack.verifier.target.compiled is not None
    accepted = 0
    for prompt, want in zip(prompts(stack.verifier.target.vocab_size), reference):
        got = generate(stack.verifier, stack.drafter, prompt, GREEDY, STOP, TREE)
        assert got.tokens == want
        accepted += got.stats.accepted
    assert accepted > 0                   # the heads read usable features off the compiled forwards
