"""Sampled output (T > 0) follows the target's own distribution on families
other than Llama: the empirical joint of the first generated tokens matches
the exact joint of the model's own forward (its final-logit processing
included). Gemma-2's final soft-cap is part of its distribution: a verifier
that skipped it is caught by the same check."""

import pytest
import torch
from families import BY_NAME, build_model
from stats import chi2_runs, chi2_sf

from specdec.local import generate
from specdec.model import causal_lm
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from specdec.tree.sampling import target_probs
from drafter.draft_lm import DraftLmDrafter
from verifier.engine import TargetModel, VerifierEngine

V, NEW, RUNS = 5, 3, chi2_runs(600)
PROMPT = [1, 3, 2]
PARAMS = SamplingParams(temperature=1.0)


def sharpened(name: str, seed: int):
    model = build_model(BY_NAME[name], V, seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return model


def exact_joint(model) -> torch.Tensor:
    """P(t1, t2, t3 | PROMPT) under the model's own forward, [V, V, V]."""
    joint = torch.ones(())
    seqs = torch.tensor([PROMPT])
    for _ in range(NEW):
        with torch.no_grad():
            logits = model(seqs).logits[:, -1].float()
        joint = (joint.reshape(-1, 1) * target_probs(logits, PARAMS)).reshape(-1)
        seqs = torch.cat([seqs.repeat_interleave(V, 0), torch.arange(V).repeat(len(seqs))[:, None]], 1)
    return joint.reshape([V] * NEW)


def pvalue(verifier, drafter, probs: torch.Tensor) -> float:
    counts = torch.zeros([V] * NEW)
    cfg = TreeParams(total_tokens=6, depth=2, expand_k=2)
    for seed in range(RUNS):
        params = SamplingParams(PARAMS.temperature, seed=seed)
        counts[tuple(generate(verifier, drafter, PROMPT, params, StopCriteria(max_new_tokens=NEW), cfg).tokens)] += 1
    expected, observed = (probs * RUNS).reshape(-1).double(), counts.reshape(-1).double()
    small = expected < 5                                   # pool sparse cells into one bin
    e = torch.cat([expected[~small], expected[small].sum()[None]])
    o = torch.cat([observed[~small], observed[small].sum()[None]])
    return chi2_sf(float(((o - e) ** 2 / e.clamp(min=1e-12)).sum()), len(e) - 1)


def engines(name: str):
    target = sharpened(name, 5)
    return target, VerifierEngine(TargetModel(ModelSpec("unused"), model=target)), \
        DraftLmDrafter(model=sharpened(name, 6))


@pytest.mark.parametrize("name", ["qwen3-moe", "gemma2", "bloom"])
def test_sampled_output_follows_the_target(name):
    target, verifier, drafter = engines(name)
    assert pvalue(verifier, drafter, exact_joint(target)) > 1e-4


def test_skipping_the_final_soft_cap_is_detected(monkeypatch):
    """Gemma-2 with logits taken as plain lm_head(hidden): the load check
    refuses it, and, that check switched off, the distribution test fails."""
    monkeypatch.setattr(causal_lm, "final_logit_transform", lambda config: lambda logits: logits)
    target = sharpened("gemma2", 5)
    assert target.config.final_logit_softcapping is not None
    with pytest.raises(causal_lm.UnsupportedModel, match="final-logit processing"):
        TargetModel(ModelSpec("unused"), model=target)
    monkeypatch.setattr(causal_lm, "check_servable", lambda lm: None)
    verifier = VerifierEngine(TargetModel(ModelSpec("unused"), model=target))
    assert verifier.target.lm.transform(torch.tensor([50.0])) == 50.0       # the cap is really skipped
    drafter = DraftLmDrafter(model=sharpened("gemma2", 6))
    assert pvalue(verifier, drafter, exact_joint(target)) < 1e-4
