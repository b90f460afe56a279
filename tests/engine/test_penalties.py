"""Penalties, the logit bias and logprobs stay lossless under speculation:
greedy output with each penalty or a bias is token-identical to plain
decoding with it (every drafter, every tree method) and to transformers'
``generate`` where it has the same processor; sampled output follows the
exact penalised (biased) target joint; logprobs equal the raw model's for the
same tokens. A verifier that penalises every tree node with the committed
prefix only (not the node's own path), or that forgets the bias when it
verifies a tree, is caught."""

from collections import Counter
from dataclasses import replace

import pytest
import torch

from specdec.local import DrafterChoice, build_local, generate
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import METHODS, SamplingParams, TreeParams
from specdec.tree import acceptance
from specdec.tree.build import tree_from_lists
from specdec.tree.sampling import History, TokenCounts, target_probs
from drafter.draft_lm import DraftLmDrafter
from verifier.engine import TargetModel, VerifierEngine
from stats import chi2_runs, chi2_sf
from trees import ChainOracle

N_PROMPTS, NEW_TOKENS = 6, 32
PENALTIES = {
    "repetition": SamplingParams(repetition_penalty=1.5),
    "frequency": SamplingParams(frequency_penalty=0.7),
    "presence": SamplingParams(presence_penalty=1.2),
    "negative": SamplingParams(frequency_penalty=-0.6, presence_penalty=-0.4),   # rewards repeats
    "all": SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3),
}
CFG = TreeParams(total_tokens=10, depth=4, expand_k=3)


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(23)
    out = []
    for _ in range(N_PROMPTS):
        n = int(torch.randint(3, 16, (1,), generator=gen))
        body = torch.randint(1, vocab, (n,), generator=gen).tolist()
        out.append(body + body[: n // 2])
    return out


@pytest.fixture(scope="module")
def stacks(tiny_family):
    spec = ModelSpec(str(tiny_family["target"]))
    return {
        "eagle": build_local(spec, DrafterChoice("eagle", str(tiny_family["eagle"]))),
        "draft-lm": build_local(spec, DrafterChoice("draft-lm", str(tiny_family["draft-lm"]))),
        "ngram": build_local(spec, DrafterChoice("ngram")),
    }


def run(stack, params, cfg=CFG, drafter=True, logprobs=None):
    stop = StopCriteria(max_new_tokens=NEW_TOKENS)
    return [generate(stack.verifier, stack.drafter if drafter else None, p, params, stop,
                     cfg if drafter else None, logprobs=logprobs)
            for p in prompts(stack.verifier.target.vocab_size)]


@pytest.fixture(scope="module")
def vanilla(stacks):
    return {name: [d.tokens for d in run(stacks["eagle"], params, drafter=False)]
            for name, params in PENALTIES.items()}


def test_penalties_change_the_output(stacks, vanilla):
    plain = [d.tokens for d in run(stacks["eagle"], SamplingParams(), drafter=False)]
    for name, outputs in vanilla.items():
        assert outputs != plain, f"{name} penalty changes nothing: the tests below would prove nothing"


@pytest.mark.parametrize("penalty", list(PENALTIES))
@pytest.mark.parametrize("drafter", ["eagle", "draft-lm", "ngram"])
def test_greedy_with_penalty_identical_to_vanilla(stacks, vanilla, drafter, penalty):
    got = [d.tokens for d in run(stacks[drafter], PENALTIES[penalty])]
    assert got == vanilla[penalty]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("drafter", ["eagle", "draft-lm", "ngram"])
def test_greedy_with_penalties_identical_to_vanilla_for_every_method(stacks, vanilla, drafter, method):
    got = [d.tokens for d in run(stacks[drafter], PENALTIES["all"], replace(CFG, method=method))]
    assert got == vanilla["all"]


def test_repetition_penalty_matches_transformers_generate(tiny_family, vanilla):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_family["target"], dtype=torch.float32).eval()
    for prompt, want in zip(prompts(model.config.vocab_size), vanilla["repetition"]):
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             repetition_penalty=1.5, eos_token_id=None, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == want


def committed_prefix_only(self, tokens, ancestors):
    """The bug the design rules out: every node penalised with the committed history alone."""
    n = tokens.shape[0]
    return TokenCounts(self.generated.expand(n, -1), self.seen.expand(n, -1))




@pytest.mark.parametrize("penalty", list(PENALTIES))
def test_penalising_with_the_committed_prefix_only_is_caught(stacks, vanilla, penalty, monkeypatch):
    stack = stacks["eagle"]
    oracle = ChainOracle({tuple(p): out for p, out in zip(prompts(stack.verifier.target.vocab_size), vanilla[penalty])})
    cfg = replace(CFG, method="chain", depth=8)
    stop = StopCriteria(max_new_tokens=NEW_TOKENS)
    right = [generate(stack.verifier, oracle, p, PENALTIES[penalty], stop, cfg)
             for p in prompts(stack.verifier.target.vocab_size)]
    assert [d.tokens for d in right] == vanilla[penalty]
    assert all(d.stats.accepted == d.stats.drafted for d in right)      # the oracle is always right
    monkeypatch.setattr(History, "node_counts", committed_prefix_only)
    wrong = [generate(stack.verifier, oracle, p, PENALTIES[penalty], stop, cfg).tokens
             for p in prompts(stack.verifier.target.vocab_size)]
    assert wrong != vanilla[penalty]


# -- logit bias -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def biased(stacks):
    """(params, plain greedy outputs with them): -100 on the token plain greedy
    decoding picks most, +2 on a token it never picks."""
    stack = stacks["eagle"]
    seen = Counter(t for d in run(stack, SamplingParams(), drafter=False) for t in d.tokens)
    favoured = next(t for t in range(stack.verifier.target.vocab_size) if t not in seen)
    params = SamplingParams(logit_bias={seen.most_common(1)[0][0]: -100.0, favoured: 2.0})
    return params, [d.tokens for d in run(stack, params, drafter=False)]


def test_the_logit_bias_changes_the_output(stacks, biased):
    params, outputs = biased
    (banned, _), (favoured, _) = sorted(params.logit_bias, key=lambda e: e[1])
    plain = [d.tokens for d in run(stacks["eagle"], SamplingParams(), drafter=False)]
    assert outputs != plain
    assert not any(banned in out for out in outputs) and any(banned in out for out in plain)
    assert any(favoured in out for out in outputs) and not any(favoured in out for out in plain)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("drafter", ["eagle", "draft-lm", "ngram"])
def test_greedy_with_logit_bias_identical_to_vanilla(stacks, biased, drafter, method):
    params, outputs = biased
    assert [d.tokens for d in run(stacks[drafter], params, replace(CFG, method=method))] == outputs


def test_greedy_with_logit_bias_and_penalties_identical_to_vanilla(stacks, biased):
    params = replace(PENALTIES["all"], logit_bias=biased[0].logit_bias)
    assert [d.tokens for d in run(stacks["eagle"], params)] == [d.tokens for d in run(stacks["eagle"], params,
                                                                                      drafter=False)]


def test_logit_bias_matches_transformers_generate(tiny_family, biased):
    from transformers import AutoModelForCausalLM

    params, outputs = biased
    model = AutoModelForCausalLM.from_pretrained(tiny_family["target"], dtype=torch.float32).eval()
    for prompt, want in zip(prompts(model.config.vocab_size), outputs):
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             sequence_bias={(t,): b for t, b in params.logit_bias}, eos_token_id=None,
                             pad_token_id=0)
        assert out[0, len(prompt):].tolist() == want


# -- logprobs -------------------------------------------------------------------------------------
def reference_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log-softmax of one full-sequence forward at the positions that produced ``tokens`` [m, V]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(frequency_penalty=0.5),
                                    SamplingParams(temperature=1.0, top_p=0.9, seed=7),
                                    SamplingParams(temperature=0.8, min_p=0.05, presence_penalty=0.5, seed=3)])
def test_logprobs_equal_the_raw_model_for_the_same_tokens(tiny_family, stacks, params):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_family["target"], dtype=torch.float32).eval()
    stack = stacks["eagle"]
    speculative = run(stack, params, logprobs=3)
    plain = run(stack, params, drafter=False, logprobs=3)
    for prompt, dec in zip(prompts(stack.verifier.target.vocab_size), speculative):
        assert len(dec.logprobs) == len(dec.tokens) == NEW_TOKENS
        want = reference_logprobs(model, prompt, dec.tokens)
        got = torch.tensor([e.logprob for e in dec.logprobs])
        assert torch.allclose(got, want.gather(-1, torch.tensor(dec.tokens)[:, None])[:, 0], atol=1e-5)
        top_vals, top_idx = want.topk(3, dim=-1)
        assert torch.allclose(torch.tensor([e.top_logprobs for e in dec.logprobs]), top_vals, atol=1e-5)
        assert [list(e.top_tokens) for e in dec.logprobs] == top_idx.tolist()
    if params.greedy:     # the same tokens as plain decoding: the same logprobs
        for spec, base in zip(speculative, plain):
            assert spec.tokens == base.tokens
            assert torch.allclose(torch.tensor([e.logprob for e in spec.logprobs]),
                                  torch.tensor([e.logprob for e in base.logprobs]), atol=1e-5)


def test_no_logprobs_unless_asked(stacks):
    assert all(d.logprobs == [] for d in run(stacks["eagle"], SamplingParams()))


# -- sampling: the exact penalised joint ----------------------------------------------------------
V, NEW, RUNS = 5, 3, chi2_runs(800)
PROMPT = [0, 4, 1]


def exact_joint(model, params: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3 | PROMPT) under the penalised, filtered target, [V, V, V]."""
    joint = torch.ones(())
    seqs = [list(PROMPT)]
    for _ in range(NEW):
        with torch.no_grad():
            logits = model(torch.tensor(seqs)).logits[:, -1]
        rows = []
        for seq, row in zip(seqs, logits):
            counts = History(V, seq, len(PROMPT)).counts()
            rows.append(target_probs(row, params, counts))
        joint = (joint.reshape(-1, 1) * torch.stack(rows)).reshape(-1)
        seqs = [seq + [t] for seq in seqs for t in range(V)]
    return joint.reshape([V] * NEW)


def sampled_joint(verifier, drafter, params: SamplingParams, method: str, proposals: str) -> torch.Tensor:
    counts = torch.zeros([V] * NEW)
    cfg = TreeParams(method=method, total_tokens=6, depth=2, expand_k=2, proposals=proposals)
    stop = StopCriteria(max_new_tokens=NEW)
    for seed in range(RUNS):
        tokens = generate(verifier, drafter, PROMPT, replace(params, seed=seed), stop, cfg).tokens
        counts[tuple(tokens)] += 1
    return counts


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = (probs * counts.sum()).reshape(-1).double()
    observed = counts.reshape(-1).double()
    if bool((observed[expected == 0] > 0).any()):
        return 0.0
    small = expected < 5
    e = torch.cat([expected[~small], expected[small].sum()[None]])
    o = torch.cat([observed[~small], observed[small].sum()[None]])
    keep = e > 0
    stat = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
    return chi2_sf(stat, int(keep.sum()) - 1)


@pytest.fixture(scope="module")
def engines():
    from tiny import tiny_llama

    target = tiny_llama(V, seed=5, hidden=32)
    draft = tiny_llama(V, seed=6, hidden=32)
    for m in (target, draft):
        for p in m.parameters():
            p.data.mul_(3.0)
    verifier = VerifierEngine(TargetModel(ModelSpec("unused"), model=target))
    return target, verifier, DraftLmDrafter(model=draft)


PENALISED = SamplingParams(temperature=1.0, frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.3,
                           min_p=0.02)


# -1e2 bans token 3 outright: a single draw of it fails the check
BIASED = SamplingParams(temperature=1.0, logit_bias={1: 1.5, 3: -100.0}, frequency_penalty=0.5, min_p=0.02)


@pytest.mark.parametrize("params,method,proposals", [
    pytest.param(PENALISED, "eagle2", "sampled", id="penalised-eagle2-sampled"),
    pytest.param(PENALISED, "eagle2", "top", id="penalised-eagle2-top"),
    pytest.param(PENALISED, "chain", "sampled", id="penalised-chain-sampled"),
    pytest.param(BIASED, "eagle2", "sampled", id="biased-eagle2-sampled"),
    pytest.param(BIASED, "eagle2", "top", id="biased-eagle2-top"),
])
def test_speculative_sampling_matches_the_processed_target(engines, params, method, proposals):
    target, verifier, drafter = engines
    counts = sampled_joint(verifier, drafter, params, method, proposals)
    assert chi2_pvalue(counts, exact_joint(target, params)) > 1e-4


def test_committed_prefix_penalties_are_caught_by_the_same_check(engines, monkeypatch):
    target, verifier, drafter = engines
    monkeypatch.setattr(History, "node_counts", committed_prefix_only)
    counts = sampled_joint(verifier, drafter, PENALISED, "eagle2", "top")
    assert chi2_pvalue(counts, exact_joint(target, PENALISED)) < 1e-4


def test_a_verifier_that_forgets_the_bias_in_trees_is_caught(engines, monkeypatch):
    target, verifier, drafter = engines
    unbiased = acceptance.target_probs
    monkeypatch.setattr(acceptance, "target_probs",
                        lambda logits, params, counts=None, allowed=None:
                        unbiased(logits, replace(params, logit_bias=()), counts, allowed))
    counts = sampled_joint(verifier, drafter, BIASED, "eagle2", "top")
    assert chi2_pvalue(counts, exact_joint(target, BIASED)) < 1e-4


def test_seeded_penalised_sampling_reproduces(stacks):
    params = replace(PENALISED, seed=99)
    assert [d.tokens for d in run(stacks["eagle"], params)] == [d.tokens for d in run(stacks["eagle"], params)]


def test_a_resumed_session_keeps_its_penalties(stacks, vanilla):
    """Failover re-prefills the committed tokens with ``resume``: the prompt
    boundary (``prompt_tokens``) keeps frequency/presence penalties on the
    generated tokens only, and the output continues as if nothing happened."""
    verifier = stacks["eagle"].verifier
    params = PENALTIES["all"]
    for prompt, want in zip(prompts(verifier.target.vocab_size), vanilla["all"]):
        tokens = list(prompt) + [verifier.prefill("before", prompt, params, NEW_TOKENS).token]
        for _ in range(5):
            tokens += verifier.verify("before", tree_from_lists([tokens[-1]], [-1])).tokens
        verifier.release("before")
        verifier.prefill("after", tokens, params, NEW_TOKENS, resume=True, prompt_tokens=len(prompt))
        while len(tokens) - len(prompt) < NEW_TOKENS:
            tokens += verifier.verify("after", tree_from_lists([tokens[-1]], [-1])).tokens
        verifier.release("after")
        assert tokens[len(prompt):] == want


def test_rollback_rolls_the_penalty_counts_back(stacks, vanilla):
    verifier = stacks["eagle"].verifier
    params = PENALTIES["all"]
    for prompt, want in zip(prompts(verifier.target.vocab_size), vanilla["all"]):
        tokens = list(prompt) + [verifier.prefill("rb", prompt, params, NEW_TOKENS).token]
        for _ in range(8):
            tokens += verifier.verify("rb", tree_from_lists([tokens[-1]], [-1])).tokens
        del tokens[len(prompt) + 3:]
        verifier.rollback("rb", len(tokens))
        while len(tokens) - len(prompt) < NEW_TOKENS:
            tokens += verifier.verify("rb", tree_from_lists([tokens[-1]], [-1])).tokens
        verifier.release("rb")
        assert tokens[len(prompt):] == want
