"""Sampling with a reduced draft vocabulary stays exactly the target's
distribution: the empirical joint of the first generated tokens against the
target's exact joint (enumerated), with sampled and top proposals; the
proposals put no mass outside the draft vocabulary."""

import pytest
import torch

from specdec.local import generate
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from specdec.tree import acceptance
from specdec.tree.sampling import target_probs
from drafter.eagle import eagle3_layouts as layouts
from drafter.eagle.eagle3 import Eagle3Drafter
from drafter.eagle.eagle3_head import Eagle3Head, head3_config, head3_config_for
from stats import chi2_runs, chi2_sf
from verifier.engine import TargetModel, VerifierEngine

V, NEW, RUNS = 5, 3, chi2_runs(1000)
PROMPT = [1, 3, 2]
DRAFT_IDS = [0, 2, 4]          # target ids of the draft vocabulary (d2t = [0, 1, 2])


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from tiny import tiny_llama

    target = tiny_llama(V, seed=5, hidden=32, layers=3)
    for p in target.parameters():
        p.data.mul_(3.0)          # low-init spread-out distributions: rejections and residual draws are frequent
    target_dir = tmp_path_factory.mktemp("target5")
    target.save_pretrained(target_dir)
    config = head3_config_for(target.config, draft_vocab_size=len(DRAFT_IDS), layers=(0, 1, 2))
    torch.manual_seed(8)
    head = Eagle3Head(head3_config(layouts.llama_fields(config)), (0, 1, 2))
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0, 0.3)
    head.set_draft_vocab(torch.tensor(DRAFT_IDS))
    head.set_embedding(target.get_input_embeddings().weight)
    verifier = VerifierEngine(TargetModel(ModelSpec(str(target_dir)), model=target))
    return target, verifier, Eagle3Drafter(None, target_dir, head=head.eval())


def exact_joint(model, params: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3 | PROMPT) under the target, [V, V, V]."""
    joint, seqs = torch.ones(()), torch.tensor([PROMPT])
    for _ in range(NEW):
        with torch.no_grad():
            p = target_probs(model(seqs).logits[:, -1], params)             # [S, V]
        joint = (joint.reshape(-1, 1) * p).reshape(-1)
        seqs = torch.cat([seqs.repeat_interleave(V, 0), torch.arange(V).repeat(len(seqs))[:, None]], 1)
    return joint.reshape([V] * NEW)


def pvalue(verifier, drafter, target, params: SamplingParams, proposals: str) -> float:
    counts = torch.zeros([V] * NEW)
    cfg = TreeParams(total_tokens=6, depth=2, expand_k=2, proposals=proposals)
    stop = StopCriteria(max_new_tokens=NEW)
    for seed in range(RUNS):
        p = SamplingParams(params.temperature, params.top_k, params.top_p, seed=seed)
        counts[tuple(generate(verifier, drafter, PROMPT, p, stop, cfg).tokens)] += 1
    expected = (exact_joint(target, params) * RUNS).reshape(-1).double()
    observed = counts.reshape(-1).double()
    small = expected < 5                      # pool sparse cells into one bin
    e = torch.cat([expected[~small], expected[small].sum()[None]])
    o = torch.cat([observed[~small], observed[small].sum()[None]])
    return chi2_sf(float(((o - e) ** 2 / e.clamp(min=1e-12)).sum()), len(e) - 1)


@pytest.mark.parametrize("params,proposals", [
    (SamplingParams(temperature=1.0), "sampled"),
    (SamplingParams(temperature=1.0), "top"),
    (SamplingParams(temperature=0.7, top_p=0.9), "sampled"),
])
def test_reduced_vocabulary_sampling_matches_the_target(engines, params, proposals):
    target, verifier, drafter = engines
    assert pvalue(verifier, drafter, target, params, proposals) > 1e-4


def test_broken_residual_is_detected_in_the_same_setting(engines, monkeypatch):
    """The check has the power to fail here: keeping the target row after a
    rejection in place of norm(max(0, p - q)) is caught."""
    target, verifier, drafter = engines
    monkeypatch.setattr(acceptance, "_drawn_residual", lambda p, q: p)
    assert pvalue(verifier, drafter, target, SamplingParams(temperature=1.0), "sampled") < 1e-4


def test_proposals_have_no_mass_outside_the_draft_vocabulary(engines):
    _, verifier, drafter = engines
    sampling = SamplingParams(temperature=1.0, seed=3)
    first = verifier.prefill("v", PROMPT, sampling, feature_layers=drafter.feature_layers)
    verifier.release("v")
    drafter.prefill("d", PROMPT + [first.token], first.features, sampling=sampling)
    tree = drafter.draft("d", TreeParams(total_tokens=8, depth=3, expand_k=3, proposals="sampled"))
    drafter.release("d")
    assert tree.proposals
    for prop in tree.proposals.values():
        outside = [t not in DRAFT_IDS for t in prop.tokens.tolist()]
        assert float(prop.probs[torch.tensor(outside)].sum()) == 0.0
    assert set(tree.tokens[1:].tolist()) <= set(DRAFT_IDS)
