"""bfloat16 and float16 targets and draft LMs load (the load check passes at
their precision) and run every method; the draft LM, a copy of the target,
has its drafts accepted; seeded sampled runs reproduce. Token identity with
vanilla is only promised in float32 (docs/models.md, "Precision")."""

import pytest
import torch
from families import BY_NAME

from specdec.local import DrafterChoice, build_local, generate
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams

NEW = 16


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["llama", "gemma3", "mistral-narrow", "falcon-alibi", "mpt"])
def test_half_precision_runs(name, dtype, family_dir):
    path = str(family_dir(BY_NAME[name]))
    stack = build_local(ModelSpec(path, dtype=dtype), DrafterChoice("draft-lm", path))
    assert stack.verifier.target.lm.dtype == getattr(torch, dtype)
    prompt = [5, 17, 33, 5, 17, 9, 40]
    stop = StopCriteria(max_new_tokens=NEW)
    vanilla = generate(stack.verifier, None, prompt, SamplingParams(), stop, None)
    assert len(vanilla.tokens) == NEW
    for method in ("eagle2", "chain", "static"):
        run = generate(stack.verifier, stack.drafter, prompt, SamplingParams(), stop, TreeParams(method=method))
        assert len(run.tokens) == NEW and run.stats.accepted > 0
    sampled = SamplingParams(temperature=1.0, seed=3)
    runs = [generate(stack.verifier, stack.drafter, prompt, sampled, stop, TreeParams()).tokens for _ in range(2)]
    assert runs[0] == runs[1]
