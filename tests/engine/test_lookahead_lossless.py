"""Lookahead decoding is lossless and its one forward is exact.

- The lookahead forward's logits (guess tree and window together) equal each
  token's visible context run alone through the model, under eager and sdpa
  attention: the mask is exactly the one ``specdec.tree.lookahead`` describes.
- Greedy output equals plain greedy decoding for several W, N, G.
- At T = 1 with penalties the committed tokens follow the exact penalised
  target joint (chi-square against the enumerated joint; the guesses are
  one-hot drafts with residual resampling), and Medusa's typical acceptance
  planted in the verifier is caught by the same check.
"""

from dataclasses import replace

import pytest
import torch

from specdec.local import generate
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from specdec.tree import acceptance
from specdec.request.lookahead import LookaheadParams
from specdec.tree.lookahead import guess_tree, window_layout
from verifier.engine import TargetModel, VerifierEngine
from verifier.lookahead import lookahead_inputs
from test_medusa_lossless import NEW, PENALISED, PROMPT, V, chi2_pvalue, exact_joint, typical_acceptance
from stats import chi2_runs

LOOKAHEAD = TreeParams(method="lookahead")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("params", [LookaheadParams(4, 3, 4), LookaheadParams(3, 4, 2), LookaheadParams(3, 2, 2)],
                         ids=str)
def test_lookahead_forward_equals_each_context_alone(tiny_family, attn, params):
    target = TargetModel(ModelSpec(str(tiny_family["target"]), attn_implementation=attn))
    gen = torch.Generator().manual_seed(3)
    v = target.vocab_size
    prefix = torch.randint(0, v, (9,), generator=gen)
    root = int(torch.randint(0, v, (1,), generator=gen))
    guesses = [tuple(torch.randint(0, v, (params.ngram - 1,), generator=gen).tolist()) for _ in range(params.guesses)]
    tree = guess_tree(root, guesses, depth=params.ngram - 1)
    cells = torch.randint(0, v, (params.cells,), generator=gen).tolist()
    p = len(prefix)
    tokens, positions, allowed = lookahead_inputs(tree, cells, params, p)
    cache = target.new_cache()
    target.forward(cache, prefix, torch.arange(p), None)
    k_pos = torch.cat([torch.arange(p), positions])
    _, logits = target.forward(cache, tokens, positions, target.masks(allowed[None], positions[None], k_pos[None]))

    def alone(context: list[int]) -> torch.Tensor:
        seq = torch.cat([prefix, torch.tensor(context, dtype=torch.int64)])
        return target.forward(target.new_cache(), seq, torch.arange(len(seq)), None)[1][-1]

    for path in tree.paths():                       # the verification branch: each node after its path
        for i, node in enumerate(path):
            torch.testing.assert_close(logits[node], alone(tree.tokens[path[:i + 1]].tolist()), atol=2e-5, rtol=0)
    layout, _ = window_layout(params.window, params.ngram)
    token_at = {(0, 0): root, **dict(zip(layout, cells))}
    for i, (r, j) in enumerate(layout):             # the lookahead branch: row 0 up to j, then column j
        context = [token_at[(0, c)] for c in range(j + 1)] + [token_at[(s, j)] for s in range(1, r + 1)]
        torch.testing.assert_close(logits[tree.size + i], alone(context), atol=2e-5, rtol=0)


PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [11, 3, 40, 2, 9], [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 4]]


@pytest.mark.parametrize("params", [LookaheadParams(4, 3, 4), LookaheadParams(2, 2, 1), LookaheadParams(3, 4, 3),
                                    LookaheadParams(1, 3, 2)], ids=str)
def test_greedy_equals_plain_decoding(tiny_family, params):
    verifier = VerifierEngine(TargetModel(ModelSpec(str(tiny_family["target"]))), lookahead=params)
    stop, accepted = StopCriteria(max_new_tokens=40), 0
    for prompt in PROMPTS:
        plain = generate(verifier, None, prompt, SamplingParams(), stop, None)
        looked = generate(verifier, None, prompt, SamplingParams(), stop, LOOKAHEAD)
        assert looked.tokens == plain.tokens
        accepted += looked.stats.accepted
    assert accepted > 0                   # guesses were accepted: the check exercises the tree
    assert len(verifier.sessions) == 0    # the sessions (and their pools) went with the requests


def test_greedy_under_the_speculation_gate(tiny_family):
    """A gate that pauses lookahead (root-only cycles, the window left as it
    was) and lets it resume: still plain decoding's tokens."""
    verifier = VerifierEngine(TargetModel(ModelSpec(str(tiny_family["target"]))))
    stop = StopCriteria(max_new_tokens=40)
    for prompt in PROMPTS:
        plain = generate(verifier, None, prompt, SamplingParams(), stop, None)
        gated = generate(verifier, None, prompt, SamplingParams(), stop, LOOKAHEAD, min_tau=3.0)
        assert gated.tokens == plain.tokens


def test_greedy_with_max_new_tokens_inside_a_guess(tiny_family):
    verifier = VerifierEngine(TargetModel(ModelSpec(str(tiny_family["target"]))))
    for n in (1, 2, 3, 5):
        stop = StopCriteria(max_new_tokens=n)
        plain = generate(verifier, None, PROMPTS[2], SamplingParams(), stop, None)
        assert generate(verifier, None, PROMPTS[2], SamplingParams(), stop, LOOKAHEAD).tokens == plain.tokens


def test_greedy_up_to_the_end_of_the_context():
    """Near the end of the context the window would run past it: those cycles
    verify the guesses alone, and the output is still plain decoding's."""
    from tiny import tiny_llama

    verifier = VerifierEngine(TargetModel(ModelSpec("unused"), model=tiny_llama(40, seed=2, max_positions=48)),
                              lookahead=LookaheadParams(6, 4, 3))
    prompt = [3, 4, 5, 6] * 5
    stop = StopCriteria(max_new_tokens=48 - len(prompt))
    plain = generate(verifier, None, prompt, SamplingParams(), stop, None)
    assert generate(verifier, None, prompt, SamplingParams(), stop, LOOKAHEAD).tokens == plain.tokens
    assert len(plain.tokens) == 28


# -- sampling ----------------------------------------------------------------------
RUNS = chi2_runs(600)


@pytest.fixture(scope="module")
def sharp():
    """A sharp 5-token target and a prompt that ends in its own greedy
    continuation: the pool starts with n-grams the target goes on to follow,
    so the guesses are often accepted even at T = 1 with penalties."""
    from tiny import tiny_llama

    target = tiny_llama(V, seed=5, hidden=32)
    for p in target.parameters():
        p.data.mul_(2.0)
    verifier = VerifierEngine(TargetModel(ModelSpec("unused"), model=target))
    greedy = generate(verifier, None, PROMPT, SamplingParams(), StopCriteria(max_new_tokens=6), None).tokens
    return target, verifier, PROMPT + greedy


def sampled_joint(verifier, prompt: list[int]) -> tuple[torch.Tensor, float]:
    counts = torch.zeros([V] * NEW)
    stop, accepted = StopCriteria(max_new_tokens=NEW), 0
    for seed in range(RUNS):
        done = generate(verifier, None, prompt, replace(PENALISED, seed=seed), stop, LOOKAHEAD)
        counts[tuple(done.tokens)] += 1
        accepted += done.stats.accepted
    return counts, accepted / RUNS


@pytest.mark.parametrize("params", [LookaheadParams(3, 3, 3), LookaheadParams(4, 2, 4)], ids=str)
def test_lookahead_sampling_matches_the_penalised_target(sharp, params, monkeypatch):
    target, verifier, prompt = sharp
    monkeypatch.setattr(verifier, "lookahead", params)
    counts, accepted = sampled_joint(verifier, prompt)
    assert accepted > 0.5                 # guesses are accepted: the check exercises the acceptance
    assert chi2_pvalue(counts, exact_joint(target, PENALISED, prompt)) > 1e-4


def test_typical_acceptance_is_caught(sharp, monkeypatch):
    """(Scored p 0.3 with the exact acceptance here, 2e-59 with this one.)"""
    target, verifier, prompt = sharp
    monkeypatch.setattr(verifier, "lookahead", LookaheadParams(3, 3, 3))
    monkeypatch.setattr(acceptance, "accept_sampling", typical_acceptance)
    counts, _ = sampled_joint(verifier, prompt)
    assert chi2_pvalue(counts, exact_joint(target, PENALISED, prompt)) < 1e-4
