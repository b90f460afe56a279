"""Completions ``echo`` with prompt logprobs, what lm-evaluation-harness's
``local-completions`` asks for log-likelihoods: the prompt's logprobs are
the target's log-softmax over the prompt (checked against a plain forward of
the tiny target), in OpenAI's shapes (null first entry, ``text_offset`` into
the echoed text), followed by the generated tokens'; ``max_tokens`` 0 scores
the prompt alone and frees its session; the same through the SDK's Complete.
(The refusals, echo with stream among them, are in ``test_errors``.)"""

from __future__ import annotations

import openai
import pytest
import torch

from specdec.client import SpecdecClient, SpecdecInvalidArgument

PROMPT = "def add(a, b):\n    return"
K = 3


def client(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.url("eagle"), api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(api, tiny_family):
    """(prompt ids, log-softmax [P - 1, V] of one plain forward of the target at
    the positions that predict prompt tokens 1..P-1)."""
    from transformers import AutoModelForCausalLM

    ids = api.stack.servicer("eagle").tokenizer.encode(PROMPT)
    model = AutoModelForCausalLM.from_pretrained(tiny_family["target"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return ids, torch.log_softmax(logits, dim=-1)


def token_text(api, token: int) -> str:
    return api.stack.servicer("eagle").tokenizer.decode([token])


def assert_prompt_logprobs(api, lp, reference) -> None:
    """The first len(prompt) entries of a choice's logprobs are the prompt's."""
    ids, logp = reference
    n = len(ids)
    assert lp.tokens[:n] == [token_text(api, t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert lp.token_logprobs[1:n] == pytest.approx(want.tolist(), abs=1e-5)
    top_vals, top_idx = logp.topk(K, dim=-1)
    for got, vals, idx in zip(lp.top_logprobs[1:n], top_vals.tolist(), top_idx.tolist()):
        assert got == pytest.approx({token_text(api, t): v for t, v in zip(idx, vals)}, abs=1e-5)


def assert_offsets_index_the_text(lp, text: str, prompt_tokens: int) -> None:
    """Offsets add up the tokens' texts; the prompt's (ASCII here) index the
    echoed text. (A random model's tokens may split a UTF-8 character, whose
    pieces decode to U+FFFD each: those do not index the choice's text.)"""
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, offset in zip(lp.tokens[:prompt_tokens], lp.text_offset):
        assert text[offset:offset + len(token)] == token
    assert "".join(lp.tokens[:prompt_tokens]) == PROMPT


def test_echo_with_max_tokens_0_scores_the_prompt_alone(api, reference):
    got = client(api).completions.create(model=api.model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=K,
                                         temperature=0, extra_body={"return_token_ids": True})
    choice = got.choices[0]
    assert choice.text == PROMPT and choice.token_ids == [] and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(reference[0])           # the prompt's tokens, none generated
    assert_prompt_logprobs(api, choice.logprobs, reference)
    assert_offsets_index_the_text(choice.logprobs, choice.text, len(reference[0]))
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(reference[0]), 0)
    assert choice.specdec["cycles"] == 0
    assert api.wait_closed() == {"verifier": 0, "drafter-eagle": 0}


def test_echo_lists_the_prompt_then_the_generated_tokens(api, reference):
    """lm-eval's log-likelihood request: echo, max_tokens 1 (its token dropped by ``[ctxlen:-1]``)."""
    for max_tokens in (1, 12):
        plain = client(api).completions.create(model=api.model, prompt=PROMPT, max_tokens=max_tokens, logprobs=K,
                                               temperature=0)
        got = client(api).completions.create(model=api.model, prompt=PROMPT, max_tokens=max_tokens, logprobs=K,
                                             temperature=0, echo=True)
        choice, n = got.choices[0], len(reference[0])
        assert choice.text == PROMPT + plain.choices[0].text
        assert_prompt_logprobs(api, choice.logprobs, reference)
        assert choice.logprobs.tokens[n:] == plain.choices[0].logprobs.tokens
        assert choice.logprobs.token_logprobs[n:] == pytest.approx(plain.choices[0].logprobs.token_logprobs,
                                                                   abs=1e-6)
        assert choice.logprobs.top_logprobs[n:] == plain.choices[0].logprobs.top_logprobs
        assert_offsets_index_the_text(choice.logprobs, choice.text, n)
        assert got.usage.completion_tokens == plain.usage.completion_tokens == max_tokens
    assert api.wait_closed() == {"verifier": 0, "drafter-eagle": 0}


def test_echo_without_logprobs_returns_prompt_and_completion(api):
    plain = client(api).completions.create(model=api.model, prompt=[PROMPT, "import os"], max_tokens=8,
                                           temperature=0)
    got = client(api).completions.create(model=api.model, prompt=[PROMPT, "import os"], max_tokens=8, temperature=0,
                                         echo=True)
    assert [c.text for c in got.choices] == [PROMPT + plain.choices[0].text, "import os" + plain.choices[1].text]
    assert all(c.logprobs is None for c in got.choices)
    alone = client(api).completions.create(model=api.model, prompt=PROMPT, max_tokens=0, echo=True)
    assert alone.choices[0].text == PROMPT and alone.choices[0].logprobs is None


def test_echo_with_n_choices_echoes_each(api, reference):
    got = client(api).completions.create(model=api.model, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=3, n=2,
                                         echo=True, logprobs=K)
    for choice in got.choices:
        assert choice.text.startswith(PROMPT)
        assert_prompt_logprobs(api, choice.logprobs, reference)


def test_the_sdk_scores_the_prompt_through_complete(api, reference):
    with SpecdecClient(api.stack.address("eagle"), timeout=60) as sdk:
        scored = sdk.complete(PROMPT, prompt_only=True, prompt_logprobs=K)
        assert scored.prompt_ids == reference[0] and scored.token_ids == [] and scored.text == ""
        want = reference[1].gather(-1, torch.tensor(reference[0][1:])[:, None])[:, 0]
        assert [e.logprob for e in scored.prompt_logprobs] == pytest.approx(want.tolist(), abs=1e-5)
        assert [e.token for e in scored.prompt_logprobs] == reference[0][1:]
        assert sdk.complete(PROMPT, max_new_tokens=3).prompt_logprobs == []
        with pytest.raises(SpecdecInvalidArgument, match="prompt_logprobs"):
            list(sdk.generate(PROMPT, max_new_tokens=3, prompt_logprobs=1))
        with pytest.raises(SpecdecInvalidArgument, match="max_new_tokens must be 0 with prompt_only"):
            sdk.complete(PROMPT, max_new_tokens=3, prompt_only=True)
    assert api.wait_closed() == {"verifier": 0, "drafter-eagle": 0}
