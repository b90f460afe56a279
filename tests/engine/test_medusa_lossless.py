"""Sampling with Medusa heads is lossless: at T = 1 with penalties the
committed tokens follow the exact penalised target joint (chi-square against
the enumerated joint), for the dynamic and the static tree, with sampled and
with top (one-hot) proposals (600 runs: the right acceptance scored p 0.4-0.9
here, the planted typical acceptance 1e-6 to 1e-9). Medusa's "typical acceptance" (accept a draft
whose target probability clears an entropy-dependent threshold) is not
lossless, and the same check catches it when planted in the verifier."""

import math
from dataclasses import replace

import pytest
import torch

from drafter.medusa import MedusaDrafter
from drafter.medusa_heads import MedusaHeads
from specdec.local import generate
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from specdec.tree import acceptance
from specdec.tree.sampling import History, sample, target_probs
from verifier.engine import TargetModel, VerifierEngine
from stats import chi2_runs, chi2_sf

V, HIDDEN, NEW, RUNS = 5, 32, 3, chi2_runs(600)
PROMPT = [0, 4, 1]
PENALISED = SamplingParams(temperature=1.0, frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.3)


@pytest.fixture(scope="module")
def engines():
    from tiny import tiny_llama

    target = tiny_llama(V, seed=5, hidden=HIDDEN)
    for p in target.parameters():
        p.data.mul_(3.0)
    torch.manual_seed(8)
    heads = MedusaHeads(HIDDEN, V, num_heads=2)
    with torch.no_grad():
        for lm in heads.lm_heads:        # sharp, partly right: the target's lm_head plus noise
            lm.weight.copy_(target.lm_head.weight + 0.5 * torch.randn_like(lm.weight))
    verifier = VerifierEngine(TargetModel(ModelSpec("unused"), model=target))
    return target, verifier, MedusaDrafter("unused", heads=heads, target=(HIDDEN, V))


def exact_joint(model, params: SamplingParams, prompt: list[int] = PROMPT) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) under the penalised target, [V, V, V]."""
    joint, seqs = torch.ones(()), [list(prompt)]
    for _ in range(NEW):
        with torch.no_grad():
            logits = model(torch.tensor(seqs)).logits[:, -1]
        rows = [target_probs(row, params, History(V, seq, len(prompt)).counts()) for seq, row in zip(seqs, logits)]
        joint = (joint.reshape(-1, 1) * torch.stack(rows)).reshape(-1)
        seqs = [seq + [t] for seq in seqs for t in range(V)]
    return joint.reshape([V] * NEW)


def sampled_joint(verifier, drafter, method: str, proposals: str) -> tuple[torch.Tensor, float]:
    """Counts of the committed tokens over RUNS seeds, and the mean tokens accepted per draft."""
    counts = torch.zeros([V] * NEW)
    cfg = TreeParams(method=method, total_tokens=6, depth=2, expand_k=2, proposals=proposals)
    stop, accepted = StopCriteria(max_new_tokens=NEW), 0
    for seed in range(RUNS):
        done = generate(verifier, drafter, PROMPT, replace(PENALISED, seed=seed), stop, cfg)
        counts[tuple(done.tokens)] += 1
        accepted += done.stats.accepted
    return counts, accepted / RUNS


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = (probs * counts.sum()).reshape(-1).double()
    observed = counts.reshape(-1).double()
    if bool((observed[expected == 0] > 0).any()):
        return 0.0
    small = expected < 5
    e = torch.cat([expected[~small], expected[small].sum()[None]])
    o = torch.cat([observed[~small], observed[small].sum()[None]])
    keep = e > 0
    return chi2_sf(float(((o[keep] - e[keep]) ** 2 / e[keep]).sum()), int(keep.sum()) - 1)


@pytest.mark.parametrize("method,proposals", [("eagle2", "sampled"), ("static", "top")],
                         ids=["medusa-sampled", "medusa-static-top"])
def test_medusa_sampling_matches_the_penalised_target(engines, method, proposals):
    target, verifier, drafter = engines
    counts, accepted = sampled_joint(verifier, drafter, method, proposals)
    assert accepted > 0.3                 # drafts are accepted: the check exercises the acceptance
    assert chi2_pvalue(counts, exact_joint(target, PENALISED)) > 1e-4


def typical_acceptance(tree, probs, generator, epsilon=0.09, delta=0.3):
    """Medusa's typical acceptance: walk down, taking the first child whose
    target probability exceeds min(epsilon, delta * exp(-H(p))); the next
    token is then sampled from p at the last node. Not lossless."""
    p = probs / probs.sum(-1, keepdim=True)
    children = [[] for _ in tree.token_list]
    for node, parent in enumerate(tree.parent_list):
        if parent >= 0:
            children[parent].append(node)
    node, accepted = 0, []
    while True:
        row = p[node].double()
        entropy = float(-(row * row.clamp_min(1e-30).log()).sum())
        threshold = min(epsilon, delta * math.exp(-entropy))
        nxt = next((c for c in children[node] if float(row[tree.token_list[c]]) > threshold), None)
        if nxt is None:
            return acceptance.Acceptance(accepted=accepted, bonus=sample(p[node], generator))
        accepted.append(nxt)
        node = nxt


def test_typical_acceptance_is_caught(engines, monkeypatch):
    target, verifier, drafter = engines
    monkeypatch.setattr(acceptance, "accept_sampling", typical_acceptance)
    counts, _ = sampled_joint(verifier, drafter, "eagle2", "top")
    assert chi2_pvalue(counts, exact_joint(target, PENALISED)) < 1e-4
