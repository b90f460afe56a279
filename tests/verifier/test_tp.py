"""Tensor parallelism (2 ranks, CPU, gloo): tokens identical to one process."""

import pytest

from specdec.local import DrafterChoice, build_local, generate
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams
from specdec.request.params import TreeParams
from verifier.tp import check_tp_degree, launch

PROMPTS = [[5, 6, 7, 8], [20, 21, 22, 20, 21], [3] * 6, [100, 50, 25, 12, 6, 3]]


def run_all(verifier, drafter):
    stop = StopCriteria(max_new_tokens=24)
    cfg = TreeParams(total_tokens=8, depth=3, expand_k=2)
    out = []
    for p in PROMPTS:
        out.append(generate(verifier, None, p, SamplingParams(), stop, None).tokens)
        out.append(generate(verifier, drafter, p, SamplingParams(), stop, cfg).tokens)
        out.append(generate(verifier, drafter, p, SamplingParams(temperature=1.0, seed=7), stop, cfg).tokens)
    return out


def test_tp2_tokens_identical_to_single_process(tiny_family):
    spec = ModelSpec(str(tiny_family["target"]))
    stack = build_local(spec, DrafterChoice("eagle", str(tiny_family["eagle"])))
    want = run_all(stack.verifier, stack.drafter)

    def rank0(verifier):
        got = run_all(verifier, stack.drafter)
        assert len(verifier.sessions) == 0
        return got

    assert launch(2, spec, rank0, threads=1) == want


def test_tp_degree_must_divide_heads(tiny_family):
    with pytest.raises(ValueError, match="must divide"):
        check_tp_degree(str(tiny_family["target"]), 3)
