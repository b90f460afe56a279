"""Lookahead decoding on compiled target forwards (``specdec.compile.forwards``):
the forward holding the guess tree and the Jacobi window runs on the compiled
path (its mask is an input like a tree's) and greedy output equals eager
vanilla decoding."""

from __future__ import annotations

from specdec.local import generate
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from verifier.engine import TargetModel, VerifierEngine

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5], [1, 2, 3, 1, 2, 3, 1, 2, 3, 4]]


def test_lookahead_runs_compiled_and_equals_eager_vanilla(tiny_family):
    target = TargetModel(ModelSpec(str(tiny_family["target"]), compile="on"))
    assert target.compiled is not None
    served = []
    run = target.compiled.run

    def counted(*args, **kwargs):
        out = run(*args, **kwargs)
        served.append(out is not None)
        return out

    target.compiled.run = counted
    compiled = VerifierEngine(target)
    eager = VerifierEngine(TargetModel(ModelSpec(str(tiny_family["target"]))))
    stop = StopCriteria(max_new_tokens=24)
    accepted = 0
    for prompt in PROMPTS:
        want = generate(eager, None, prompt, SamplingParams(), stop, None).tokens
        got = generate(compiled, None, prompt, SamplingParams(), stop, TreeParams(method="lookahead"))
        assert got.tokens == want
        accepted += got.stats.accepted
    assert accepted > 0 and served and all(served)        # every forward, lookahead ones included, compiled
