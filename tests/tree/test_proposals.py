"""Sampled proposals (specdec.tree.proposals): drawn trees and their acceptance.

A Markov-chain "model" stands in for target and drafter (next-token logits
depend on the last token only), so the exact joint of the first tokens is known
and every cycle is cheap: the tests run the whole draft -> accept loop many
times and check the committed tokens against the target's joint, for each tree
method, and that planted bugs in the recursive rejection are caught."""

from collections import Counter
from dataclasses import replace

import pytest
import torch

from specdec.request.params import SamplingParams
from specdec.request.params import TreeParams
from specdec.tree.acceptance import accept_sampling
from specdec.tree.build import build_tree, sampled_level_budget, tree_from_lists
from specdec.tree.proposals import Proposal, ProposalError, ProposalSampler, check_proposals
from specdec.tree.sampling import make_generator, target_probs
import specdec.tree.acceptance as acceptance
from stats import chi2_pvalue, chi2_runs

V, NEW, RUNS = 5, 3, chi2_runs(2000)
ROOT = 0


def _chain_logits(seed: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g) * scale          # [V, V]: row = last token


TARGET = _chain_logits(1, 1.5)
DRAFT = TARGET + _chain_logits(2, 0.8)                        # close to the target, not equal
POOR_DRAFT = TARGET + _chain_logits(3, 2.5)                   # often rejected: bugs show sooner


def _expand(frontier, draft=DRAFT):
    return torch.log_softmax(draft[frontier.tokens], dim=-1)  # [f, V]


def _exact_joint(params: SamplingParams) -> dict[tuple, float]:
    step = target_probs(TARGET, params).double()              # [V, V]
    out = {(): 1.0}
    for _ in range(NEW):
        out = {seq + (x,): p * float(step[seq[-1] if seq else ROOT, x]) for seq, p in out.items() for x in range(V)}
    return out


def _generate(cfg: TreeParams, params: SamplingParams, seed: int, draft: torch.Tensor) -> tuple[int, ...]:
    gen = make_generator(seed)
    tokens = [ROOT]
    while len(tokens) <= NEW:
        sampler = ProposalSampler(params, seed, salt=len(tokens))
        tree = build_tree(tokens[-1], lambda f: _expand(f, draft), cfg, sampler)
        probs = target_probs(TARGET[tree.tokens], params)     # [n, V]
        tokens += accept_sampling(tree, probs, gen).tokens(tree)
    return tuple(tokens[1:NEW + 1])


def _joint_pvalue(cfg: TreeParams, params: SamplingParams, draft: torch.Tensor = DRAFT) -> float:
    """The smallest p-value of the first token, the first two and all NEW
    tokens against the target's exact joint."""
    runs = [_generate(cfg, params, seed, draft) for seed in range(RUNS)]
    exact = _exact_joint(params)
    pvalues = []
    for n in (1, 2, NEW):
        marginal: dict[tuple, float] = {}
        for seq, prob in exact.items():
            marginal[seq[:n]] = marginal.get(seq[:n], 0.0) + prob
        pvalues.append(chi2_pvalue(Counter(r[:n] for r in runs), marginal, RUNS))
    return min(pvalues)


CASES = {
    "eagle2 T=1": (TreeParams(method="eagle2", total_tokens=8, depth=3, expand_k=3), SamplingParams(1.0)),
    "eagle2 T=0.7 top_p=0.9": (TreeParams(method="eagle2", total_tokens=8, depth=3, expand_k=3),
                               SamplingParams(0.7, top_p=0.9)),
    "chain T=1": (TreeParams(method="chain", total_tokens=4, depth=3), SamplingParams(1.0)),
    "static T=1 top_k=3": (TreeParams(method="static", total_tokens=6, depth=2,
                                      static_shape=((0,), (1,), (2,), (0, 0), (0, 1))),
                           SamplingParams(1.0, top_k=3)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sampled_trees_are_lossless(name):
    cfg, params = CASES[name]
    assert _joint_pvalue(cfg, params) > 1e-4
    assert _joint_pvalue(cfg, params, POOR_DRAFT) > 1e-4


@pytest.mark.parametrize("bug", ["residual kept", "proposal kept"])
def test_broken_recursive_rejection_is_detected(bug, monkeypatch):
    """Without p <- norm(max(0, p - q)) after a rejection, or with q keeping the
    rejected draws, the committed tokens drift from the target: the same test fails."""
    if bug == "residual kept":
        monkeypatch.setattr(acceptance, "_drawn_residual", lambda p, q: p)
    else:
        monkeypatch.setattr(acceptance, "_without", lambda q, x: q)
    cfg, params = CASES["eagle2 T=1"]
    assert _joint_pvalue(cfg, params, POOR_DRAFT) < 1e-4


def test_acceptance_is_one_when_draft_equals_target():
    """q == p: every drawn child on the path is accepted, whatever was drawn."""
    params = SamplingParams(1.0)

    def same(frontier):
        return torch.log_softmax(TARGET[frontier.tokens], dim=-1)

    cfg = TreeParams(method="chain", total_tokens=5, depth=4)
    for seed in range(50):
        tree = build_tree(ROOT, same, cfg, ProposalSampler(params, seed))
        result = accept_sampling(tree, target_probs(TARGET[tree.tokens], params), make_generator(seed))
        assert result.accepted == [1, 2, 3, 4]


def test_draws_follow_seed_and_salt():
    params = SamplingParams(1.0)
    cfg = TreeParams(total_tokens=10, depth=4, expand_k=3)

    def tree(seed, salt):
        t = build_tree(ROOT, _expand, cfg, ProposalSampler(params, seed, salt))
        return t.tokens.tolist(), t.parents.tolist()

    assert tree(7, 3) == tree(7, 3)
    assert len({str(tree(7, salt)) for salt in range(8)}) > 1


def test_sampled_tree_shape_and_proposals():
    """No rerank: every draw stays, each level has the draws its prior budget
    gives, at most expand_k per node; each expanded node's proposal holds its
    children, drawn without replacement."""
    cfg = TreeParams(total_tokens=12, depth=5, expand_k=3)
    budget = sampled_level_budget(12, 5, 3)
    assert 5 <= sum(budget) <= 11 and budget[0] >= 1
    for seed in range(20):
        tree = build_tree(ROOT, _expand, cfg, ProposalSampler(SamplingParams(1.0), seed))
        per_level = Counter(tree.depths.tolist()[1:])
        assert [per_level[d] for d in range(1, 6)] == budget
        kids = tree.children()
        assert max(len(k) for k in kids) <= 3
        assert set(tree.proposals) == {i for i, k in enumerate(kids) if k}
        check_proposals(tree.proposals, tree.tokens.tolist(), tree.parents.tolist(), V)
        for node, prop in tree.proposals.items():
            drawn = tree.tokens[kids[node]].tolist()
            assert len(set(drawn)) == len(drawn)
            assert abs(float(prop.probs.sum()) - 1) < 1e-5


def test_chain_draws_one_child_per_level():
    tree = build_tree(ROOT, _expand, TreeParams(method="chain", total_tokens=6, depth=4),
                      ProposalSampler(SamplingParams(1.0), 0))
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3]


def test_top_k_one_leaves_one_draw_per_node():
    """With top_k=1 the proposal has one token: a node cannot draw a second child."""
    tree = build_tree(ROOT, _expand, TreeParams(total_tokens=10, depth=3, expand_k=3),
                      ProposalSampler(SamplingParams(1.0, top_k=1), 0))
    assert all(len(k) <= 1 for k in tree.children())
    assert tree.tokens[1] == int(DRAFT[ROOT].argmax())


def _tree_with(proposal: Proposal):
    return [ROOT, 1, 3], [-1, 0, 0], {0: proposal}


@pytest.mark.parametrize("proposal,message", [
    (Proposal(torch.tensor([1, 3]), torch.tensor([0.5, 0.6])), "sum to"),
    (Proposal(torch.tensor([1, 1]), torch.tensor([0.5, 0.5])), "repeat"),
    (Proposal(torch.tensor([1, 4]), torch.tensor([0.5, 0.5])), "child token 3"),
    (Proposal(torch.tensor([1, 3]), torch.tensor([1.0, 0.0])), "child token 3"),
    (Proposal(torch.tensor([1, 9]), torch.tensor([0.5, 0.5])), "outside the vocabulary"),
    (Proposal(torch.tensor([1, 3]), torch.tensor([float("nan"), 0.5])), "finite"),
])
def test_check_proposals_names_the_problem(proposal, message):
    tokens, parents, props = _tree_with(proposal)
    with pytest.raises(ProposalError, match=message):
        check_proposals(props, tokens, parents, V)


def test_check_proposals_rejects_a_leaf_and_repeated_children():
    ok = Proposal(torch.tensor([1, 3]), torch.tensor([0.5, 0.5]))
    with pytest.raises(ProposalError, match="no children"):
        check_proposals({1: ok}, [ROOT, 1, 3], [-1, 0, 0], V)
    with pytest.raises(ProposalError, match="children repeat"):
        check_proposals({0: ok}, [ROOT, 1, 1], [-1, 0, 0], V)


def test_level_budget_follows_the_priors():
    """A chain first (the first draw is the likeliest), side draws where their
    prior beats going deeper, never past depth or total, nothing under
    SAMPLED_MIN_PRIOR."""
    assert sampled_level_budget(6, 5, 1) == [1, 1, 1, 1, 1]
    assert sampled_level_budget(7, 6, 4) == [2, 1, 1, 1, 1, 0]    # 0.6 * 0.1 at the root > 0.6^6
    assert sampled_level_budget(16, 6, 4) == [2, 3, 1, 1, 1, 1]   # 0.6^6 = 0.047; 0.6^2 * 0.1 = 0.036
    assert sampled_level_budget(100, 2, 2) == [2, 3]              # (1, 1): 0.6^2 * 0.01 < 0.03
    assert sampled_level_budget(1, 6, 4) == [0] * 6
    assert sampled_level_budget(100, 12, 1) == [1] * 6 + [0] * 6  # 0.6^7 = 0.028



def _mixed_tree(root: int, g: torch.Generator):
    """Under ``root``: two children drawn from a poor draft's distribution
    (nodes 1, 2), node 1 with two one-hot children (tokens 1 and 4), node 2
    with one child drawn from the draft's (node 3 or 5)."""
    root_q = torch.softmax(POOR_DRAFT[root], -1)
    first = torch.multinomial(root_q, 2, replacement=False, generator=g).tolist()      # draws in order
    q2 = torch.softmax(DRAFT[first[1]], -1)
    second = int(torch.multinomial(q2, 1, generator=g))
    tree = tree_from_lists([root, *first, 1, 4, second], [-1, 0, 0, 1, 1, 2])
    proposals = {0: Proposal(torch.arange(V), root_q), 2: Proposal(torch.arange(V), q2)}
    return replace(tree, proposals=check_proposals(proposals, tree.token_list, tree.parent_list, V))


def _mixed_runs(runs: int) -> Counter:
    step = target_probs(TARGET, SamplingParams(1.0))                      # [V, V]: the target after each token
    out = Counter()
    for seed in range(runs):
        g = make_generator(seed)
        tokens = [ROOT]
        while len(tokens) <= 2:
            tree = _mixed_tree(tokens[-1], g)
            tokens += accept_sampling(tree, step[tree.tokens], g).tokens(tree)
        out[tuple(tokens[1:3])] += 1
    return out


def test_a_tree_mixing_drawn_and_one_hot_children_is_walked_losslessly_on_the_device(monkeypatch):
    """The device walk (``sampled_order`` with a ``ProposalTable``) over trees
    whose nodes drew their children or took them one-hot: the first two
    tokens follow the target's joint; without the drawn residual the same
    check fails."""
    runs = chi2_runs(3000)
    step = target_probs(TARGET, SamplingParams(1.0)).double()
    joint = {(x, y): float(step[ROOT, x] * step[x, y]) for x in range(V) for y in range(V)}
    assert chi2_pvalue(_mixed_runs(runs), joint, runs) > 1e-4
    monkeypatch.setattr(acceptance, "_drawn_residual", lambda p, q: p)
    assert chi2_pvalue(_mixed_runs(runs), joint, runs) < 1e-4
