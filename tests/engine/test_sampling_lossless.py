"""Speculative sampling through the real engines is distributed exactly as the
target: the empirical joint of the first generated tokens matches the target's
exact joint (enumerated), and a deliberately broken residual step is caught."""


import pytest
import torch

from specdec.local import generate
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams
from specdec.request.params import TreeParams
from specdec.tree.sampling import target_probs
import specdec.tree.acceptance as acceptance
from drafter.draft_lm import DraftLmDrafter
from verifier.engine import TargetModel, VerifierEngine
from stats import chi2_runs, chi2_sf

V, NEW, RUNS = 5, 3, chi2_runs(1500)
PROMPT = [1, 3, 2]


def exact_joint(model, params: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3 | PROMPT) under the target, [V, V, V]."""
    joint = torch.ones(())
    seqs = torch.tensor([PROMPT])
    for _ in range(NEW):
        with torch.no_grad():
            logits = model(seqs).logits[:, -1]
        p = target_probs(logits, params)                                  # [S, V]
        joint = (joint.reshape(-1, 1) * p).reshape(-1)
        seqs = torch.cat([seqs.repeat_interleave(V, 0), torch.arange(V).repeat(len(seqs))[:, None]], 1)
    return joint.reshape([V] * NEW)


def sampled_joint(verifier, drafter, params: SamplingParams, method: str, proposals: str = "auto",
                  value_temperature: float | None = None, min_tau: float = 0.0) -> torch.Tensor:
    counts = torch.zeros([V] * NEW)
    cfg = TreeParams(method=method, total_tokens=6, depth=2, expand_k=2, value_temperature=value_temperature,
                     proposals=proposals)
    stop = StopCriteria(max_new_tokens=NEW)
    for seed in range(RUNS):
        p = SamplingParams(params.temperature, params.top_k, params.top_p, seed=seed)
        tokens = generate(verifier, drafter, PROMPT, p, stop, cfg, min_tau).tokens
        counts[tuple(tokens)] += 1
    return counts


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = (probs * counts.sum()).reshape(-1).double()
    observed = counts.reshape(-1).double()
    small = expected < 5                      # pool sparse cells into one bin
    e = torch.cat([expected[~small], expected[small].sum()[None]])
    o = torch.cat([observed[~small], observed[small].sum()[None]])
    stat = float(((o - e) ** 2 / e.clamp(min=1e-12)).sum())
    return chi2_sf(stat, len(e) - 1)


@pytest.fixture(scope="module")
def engines():
    from tiny import tiny_llama

    # low-init models: spread-out distributions, so rejections and residual draws are frequent
    target = tiny_llama(V, seed=5, hidden=32)
    draft = tiny_llama(V, seed=6, hidden=32)
    for m in (target, draft):
        for p in m.parameters():
            p.data.mul_(3.0)
    verifier = VerifierEngine(TargetModel(ModelSpec("unused"), model=target))
    return target, verifier, DraftLmDrafter(model=draft)


@pytest.mark.parametrize("params,method,proposals,value_temperature,min_tau", [
    (SamplingParams(temperature=1.0), "eagle2", "sampled", None, 0.0),
    (SamplingParams(temperature=1.0), "eagle2", "top", None, 0.0),
    (SamplingParams(temperature=0.7, top_p=0.9), "eagle2", "sampled", None, 0.0),
    (SamplingParams(temperature=1.0), "chain", "sampled", None, 0.0),
    (SamplingParams(temperature=1.0), "eagle2", "top", 0.3, 0.0),      # another tree shape, the same distribution
    (SamplingParams(temperature=1.0), "eagle2", "sampled", None, 1.5),  # drafting paused after poor cycles
])
def test_speculative_sampling_matches_target_distribution(engines, params, method, proposals, value_temperature,
                                                          min_tau):
    target, verifier, drafter = engines
    probs = exact_joint(target, params)
    counts = sampled_joint(verifier, drafter, params, method, proposals, value_temperature, min_tau)
    assert chi2_pvalue(counts, probs) > 1e-4


def test_broken_residual_is_detected(engines, monkeypatch):
    """Drawing the bonus from the unfiltered target row (forgetting to remove
    rejected drafts) over-produces drafted tokens: the same check must fail."""
    target, verifier, drafter = engines
    params = SamplingParams(temperature=1.0)
    monkeypatch.setattr(acceptance, "_draw_residual", lambda row, rejected, gen: acceptance.sample(row, gen))
    monkeypatch.setattr(acceptance, "_residual", lambda row, rejected: row)     # the walk over every node at once
    counts = sampled_joint(verifier, drafter, params, "eagle2", "top")
    assert chi2_pvalue(counts, exact_joint(target, params)) < 1e-4


def test_broken_drawn_residual_is_detected(engines, monkeypatch):
    """With sampled proposals: keeping the target row after a rejection in place
    of norm(max(0, p - q)) is caught by the same check."""
    target, verifier, drafter = engines
    params = SamplingParams(temperature=1.0)
    monkeypatch.setattr(acceptance, "_drawn_residual", lambda p, q: p)
    counts = sampled_joint(verifier, drafter, params, "eagle2", "sampled")
    assert chi2_pvalue(counts, exact_joint(target, params)) < 1e-4


def test_same_seed_same_output(engines):
    _, verifier, drafter = engines
    params = SamplingParams(temperature=1.0, seed=1234)
    stop = StopCriteria(max_new_tokens=20)
    cfg = TreeParams(total_tokens=6, depth=3, expand_k=2)
    runs = [generate(verifier, drafter, PROMPT, params, stop, cfg).tokens for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
