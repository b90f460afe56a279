"""Structured output stays exact under speculation: greedy constrained output is
token-identical to plain constrained greedy decoding (an independent loop: the
model's logits masked by an llguidance matcher) for a JSON schema, a regex, a
Lark grammar and a tool's parameters, with every drafter and tree method and with lookahead decoding;
sampled constrained output follows the exact masked, penalised target joint
(chi-square); a verifier that masks every node with the committed state's
grammar mask instead of its own path's is caught by both checks."""

import json
import re
from collections import Counter
from dataclasses import replace

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch

from drafter.hydra_heads import save_heads as save_hydra_heads
from drafter.medusa_heads import save_heads
from specdec.local import DrafterChoice, build_local, generate
from specdec.model.loading import ModelSpec
from specdec.request.constraints import Constraint
from specdec.request.decoding import StopCriteria
from specdec.request.errors import FailedPrecondition
from specdec.request.params import METHODS, SamplingParams, TreeParams
from specdec.tree.grammar import GrammarState, token_mask
from specdec.tree.sampling import History, target_probs
from stats import chi2_runs, chi2_sf
from trees import ChainOracle
from tiny import tiny_hydra, tiny_medusa

SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "color": {"enum": ["red", "green", "blue"]}}, "required": ["ok", "n", "color"], "additionalProperties": False}
TOOL_PARAMETERS = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"type": "string", "maxLength": 3}}, "required": ["city", "days", "unit"],
    "additionalProperties": False}
REGEX = r"(x[yz]|y[xz]|z[xy]){3}"
GRAMMAR = 'start: "answer: " ANSWER " because " REASON\nANSWER: "yes" | "no" | "maybe"\nREASON: /[a-z]{1,6}/'
CONSTRAINTS = {
    "json_schema": Constraint("json_schema", json.dumps(SCHEMA)),
    "regex": Constraint("regex", REGEX),
    "grammar": Constraint("grammar", GRAMMAR),
    "tool": Constraint("json_schema", json.dumps(TOOL_PARAMETERS)),     # a named tool's arguments
}
MAX_NEW = 48
CFG = TreeParams(total_tokens=10, depth=4, expand_k=3)
PROMPTS = ["def add(a, b):", "class Point:", "for i in range(10):"]


@pytest.fixture(scope="module")
def stacks(tiny_family, model, tmp_path_factory):
    spec = ModelSpec(str(tiny_family["target"]))
    medusa_heads = tmp_path_factory.mktemp("medusa")
    save_heads(tiny_medusa(model, seed=3, num_heads=4), medusa_heads, "original")
    hydra_heads = tmp_path_factory.mktemp("hydra")
    save_hydra_heads(tiny_hydra(model, seed=3, num_heads=4), hydra_heads)
    return {
        "eagle": build_local(spec, DrafterChoice("eagle", str(tiny_family["eagle"]))),
        "draft-lm": build_local(spec, DrafterChoice("draft-lm", str(tiny_family["draft-lm"]))),
        "ngram": build_local(spec, DrafterChoice("ngram")),
        "medusa": build_local(spec, DrafterChoice("medusa", str(medusa_heads))),
        "hydra": build_local(spec, DrafterChoice("hydra", str(hydra_heads))),
    }


@pytest.fixture(scope="module")
def model(tiny_family):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_family["target"], dtype=torch.float32).eval()


def prompt_ids(stack) -> list[list[int]]:
    return [stack.tokenizer(p)["input_ids"] for p in PROMPTS]


def stop_for(stack, max_new: int = MAX_NEW) -> StopCriteria:
    return StopCriteria(max_new_tokens=max_new, eos_ids=frozenset({stack.tokenizer.eos_token_id}))


def run(stack, params, cfg=CFG, drafter=True, logprobs=None):
    return [generate(stack.verifier, stack.drafter if drafter else None, p, params, stop_for(stack),
                     cfg if drafter else None, logprobs=logprobs) for p in prompt_ids(stack)]


@torch.no_grad()
def reference_greedy(model, tokenizer, constraint: Constraint, prompt: list[int], max_new: int) -> list[int]:
    """Plain constrained greedy decoding, written independently of the engines:
    a full forward per token, the argmax of the logits the matcher allows."""
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer), constraint.grammar())
    seq, out = list(prompt), []
    for _ in range(max_new):
        logits = model(torch.tensor([seq])).logits[0, -1].float()
        allowed = token_mask(matcher, logits.shape[-1])
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        out.append(token)
        seq.append(token)
        if token == tokenizer.eos_token_id:
            break
        assert matcher.consume_token(token)
    return out


@pytest.fixture(scope="module")
def reference(stacks, model):
    stack = stacks["eagle"]
    return {kind: [reference_greedy(model, stack.tokenizer, c, p, MAX_NEW) for p in prompt_ids(stack)]
            for kind, c in CONSTRAINTS.items()}


def text_of(stack, tokens: list[int]) -> str:
    eos = stack.tokenizer.eos_token_id
    return stack.tokenizer.decode(tokens[:tokens.index(eos)] if eos in tokens else tokens)


def test_reference_outputs_are_complete_and_valid(stacks, reference):
    """The grammars end within MAX_NEW tokens and the outputs satisfy them (else
    the equality tests below would compare truncated noise)."""
    stack = stacks["eagle"]
    eos = stack.tokenizer.eos_token_id
    for kind, outputs in reference.items():
        for tokens in outputs:
            assert tokens[-1] == eos, f"{kind}: the grammar did not complete: {text_of(stack, tokens)!r}"
            text = text_of(stack, tokens)
            if kind in ("json_schema", "tool"):
                jsonschema.validate(json.loads(text), SCHEMA if kind == "json_schema" else TOOL_PARAMETERS)
            elif kind == "regex":
                assert re.fullmatch(REGEX, text)
            else:
                assert re.fullmatch(r"answer: (yes|no|maybe) because [a-z]{1,6}", text)
    unconstrained = [d.tokens for d in run(stack, SamplingParams(), drafter=False)]
    assert all(unconstrained != outputs for outputs in reference.values())


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
@pytest.mark.parametrize("drafter", ["eagle", "draft-lm", "ngram", "medusa", "hydra"])
def test_greedy_constrained_identical_to_plain(stacks, reference, drafter, kind):
    params = SamplingParams(constraint=CONSTRAINTS[kind])
    assert [d.tokens for d in run(stacks[drafter], params, drafter=False)] == reference[kind]
    speculative = run(stacks[drafter], params)
    assert [d.tokens for d in speculative] == reference[kind]
    if drafter != "ngram":          # masked drafts: most drafted tokens are the grammar's and accepted
        assert sum(d.stats.accepted for d in speculative) > 0


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_greedy_constrained_lookahead_identical_to_plain(stacks, reference, kind):
    """Lookahead decoding (no drafter): the pool's guesses are masked along their
    own paths by the verifier's acceptance like any drafter's nodes."""
    stack, params = stacks["ngram"], SamplingParams(constraint=CONSTRAINTS[kind])
    looked = [generate(stack.verifier, None, p, params, stop_for(stack), TreeParams(method="lookahead"))
              for p in prompt_ids(stack)]
    assert [d.tokens for d in looked] == reference[kind]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_constrained_identical_for_every_method(stacks, reference, method):
    params = SamplingParams(constraint=CONSTRAINTS["json_schema"])
    assert [d.tokens for d in run(stacks["eagle"], params, replace(CFG, method=method))] == reference["json_schema"]


def test_greedy_constrained_with_penalties_bias_and_logprobs(stacks):
    stack = stacks["eagle"]
    params = SamplingParams(constraint=CONSTRAINTS["tool"], frequency_penalty=0.8, repetition_penalty=1.3,
                            logit_bias={stack.tokenizer.convert_tokens_to_ids("3"): 5.0})
    plain = run(stack, params, drafter=False, logprobs=2)
    speculative = run(stack, params, logprobs=2)
    assert [d.tokens for d in speculative] == [d.tokens for d in plain]
    for spec, base in zip(speculative, plain):
        assert len(spec.logprobs) == len(spec.tokens)
        assert torch.allclose(torch.tensor([e.logprob for e in spec.logprobs]),
                              torch.tensor([e.logprob for e in base.logprobs]), atol=1e-5)
        jsonschema.validate(json.loads(text_of(stack, spec.tokens)), TOOL_PARAMETERS)


def test_sampled_constrained_outputs_validate(stacks):
    stack = stacks["eagle"]
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed, constraint=CONSTRAINTS["json_schema"])
        for dec in run(stack, params):
            jsonschema.validate(json.loads(text_of(stack, dec.tokens)), SCHEMA)


# -- the planted bug: every node masked with the committed state's mask ------------------------
def committed_state_only(self, tokens, parents):
    """What the design rules out: the grammar state of the committed prefix for every node."""
    return self.mask().expand(len(tokens), -1).clone()




@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_masking_with_the_committed_state_only_is_caught(stacks, reference, kind, monkeypatch):
    stack = stacks["eagle"]
    oracle = ChainOracle({tuple(p): out for p, out in zip(prompt_ids(stack), reference[kind])})
    cfg = replace(CFG, method="chain", depth=8)
    params = SamplingParams(constraint=CONSTRAINTS[kind])
    right = [generate(stack.verifier, oracle, p, params, stop_for(stack), cfg) for p in prompt_ids(stack)]
    assert [d.tokens for d in right] == reference[kind]
    assert all(d.stats.accepted == d.stats.drafted for d in right)
    monkeypatch.setattr(GrammarState, "node_masks", committed_state_only)
    try:
        wrong = [generate(stack.verifier, oracle, p, params, stop_for(stack), cfg).tokens for p in prompt_ids(stack)]
    except FailedPrecondition:          # the verifier committed a token its own grammar refuses
        wrong = None
    assert wrong != reference[kind]


# -- sampling: the exact constrained joint -----------------------------------------------------
NEW, RUNS, PLANTED_RUNS = 3, chi2_runs(400), chi2_runs(400)
SAMPLED = SamplingParams(temperature=1.0, frequency_penalty=0.7, repetition_penalty=1.2,
                         constraint=Constraint("regex", r"(x[yz]|y[xz]|z[xy]|xx|yy)(x[yz]|y[xz]|z[xy]|zz)"))


@torch.no_grad()
def exact_joint(model, tokenizer, params: SamplingParams, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """P(t1..tNEW | prompt) under the masked, penalised target, over every sequence the grammar allows."""
    grammar_tok = llguidance.hf.from_tokenizer(tokenizer)
    joint = {(): 1.0}
    for _ in range(NEW):
        nxt = {}
        for seq, p in joint.items():
            matcher = llguidance.LLMatcher(grammar_tok, params.constraint.grammar())
            assert matcher.consume_tokens(list(seq)) or not seq
            logits = model(torch.tensor([prompt + list(seq)])).logits[0, -1].float()
            counts = History(logits.shape[-1], prompt + list(seq), len(prompt)).counts()
            probs = target_probs(logits, params, counts, token_mask(matcher, logits.shape[-1]))
            for t in probs.nonzero()[:, 0].tolist():
                nxt[seq + (t,)] = p * float(probs[t])
        joint = nxt
    return joint


def sampled_counts(stack, params: SamplingParams, prompt: list[int], proposals: str, runs: int = RUNS) -> Counter:
    cfg = TreeParams(method="eagle2", total_tokens=6, depth=2, expand_k=2, proposals=proposals)
    counts = Counter()
    for seed in range(runs):
        try:
            tokens = generate(stack.verifier, stack.drafter, prompt, replace(params, seed=seed),
                              StopCriteria(max_new_tokens=NEW), cfg).tokens
        except FailedPrecondition:
            tokens = ("refused",)
        counts[tuple(tokens)] += 1
    return counts


def chi2_pvalue(counts: Counter, joint: dict) -> float:
    if any(cell not in joint for cell in counts):
        return 0.0
    n = sum(counts.values())
    cells, rare_o, rare_e = [], 0, 0.0
    for cell, p in joint.items():
        if p * n >= 5:
            cells.append((counts.get(cell, 0), p * n))
        else:
            rare_o, rare_e = rare_o + counts.get(cell, 0), rare_e + p * n
    cells.append((rare_o, rare_e))
    stat = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    return chi2_sf(stat, sum(1 for _, e in cells if e > 0) - 1)


@pytest.fixture(scope="module")
def sampled_case(stacks, model):
    stack = stacks["draft-lm"]
    prompt = prompt_ids(stack)[0]
    joint = exact_joint(model, stack.tokenizer, SAMPLED, prompt)
    assert len(joint) > 4 and max(joint.values()) < 0.8        # a real distribution to test against
    return stack, prompt, joint


def test_speculative_sampling_matches_the_constrained_target(sampled_case):
    """Sampled proposals from the masked draft distribution (q renormalised over
    the allowed tokens); top proposals go through the same masks (greedy tests)."""
    stack, prompt, joint = sampled_case
    assert chi2_pvalue(sampled_counts(stack, SAMPLED, prompt, "sampled"), joint) > 1e-4


def test_committed_state_masks_are_caught_by_the_same_check(sampled_case, monkeypatch):
    stack, prompt, joint = sampled_case
    monkeypatch.setattr(GrammarState, "node_masks", committed_state_only)
    assert chi2_pvalue(sampled_counts(stack, SAMPLED, prompt, "top", PLANTED_RUNS), joint) < 1e-4


def test_a_verifier_without_a_tokenizer_refuses_constrained_requests(stacks):
    from verifier.engine import VerifierEngine

    bare = VerifierEngine(stacks["eagle"].verifier.target)
    with pytest.raises(FailedPrecondition, match="no tokenizer for structured output"):
        bare.prefill("s", [1, 2, 3], SamplingParams(constraint=CONSTRAINTS["regex"]))
    assert len(bare.sessions) == 0
    bare.prefill("s", [1, 2, 3], SamplingParams())          # unconstrained requests are served
