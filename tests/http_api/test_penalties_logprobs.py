"""Penalties, logit_bias, min_p, logprobs and n through the official ``openai``
client: the same tokens and logprobs as the SDK over gRPC, in OpenAI's shapes;
chat ``messages`` sent over gRPC render with the HTTP API's chat template."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from specdec.client import SpecdecClient

PROMPT = "def add(a, b):"
CHAT = [{"role": "user", "content": "def add(a, b):"}]
N = 16
PENALTIES = {"frequency_penalty": 0.8, "presence_penalty": 0.5, "repetition_penalty": 1.3}


def client(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.url("eagle"), api_key="unused", max_retries=0)


def grpc_complete(api, prompt=PROMPT, **params):
    with SpecdecClient(api.stack.address("eagle"), timeout=60) as sdk:
        return sdk.complete(prompt, max_new_tokens=N, **params)


def token_text(api, token: int) -> str:
    return api.stack.servicer("eagle").tokenizer.decode([token])


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 0.8}, {"presence_penalty": 1.5},
                                     {"repetition_penalty": 1.3}, PENALTIES])
def test_greedy_with_a_penalty_equals_vanilla_decoding_with_it(api, penalty):
    vanilla = grpc_complete(api, method="vanilla", **penalty)
    plain = grpc_complete(api, method="vanilla")
    extra = {"return_token_ids": True}
    if "repetition_penalty" in penalty:
        extra["repetition_penalty"] = penalty["repetition_penalty"]
    openai_kw = {k: v for k, v in penalty.items() if k != "repetition_penalty"}
    got = client(api).completions.create(model=api.model, prompt=PROMPT, max_tokens=N, temperature=0,
                                         extra_body=extra, **openai_kw)
    assert got.choices[0].token_ids == vanilla.token_ids
    assert vanilla.token_ids != plain.token_ids          # the penalty changed the output
    assert got.choices[0].specdec["cycles"] < N          # and speculation was on


@pytest.fixture(scope="module")
def logit_bias(api) -> dict[int, float]:
    """-100 on the first token plain greedy decoding picks, +3 on one it never picks."""
    plain = grpc_complete(api, method="vanilla").token_ids
    favoured = next(t for t in range(50, 300) if t not in plain)
    return {plain[0]: -100.0, favoured: 3.0}


def test_greedy_with_a_logit_bias_equals_vanilla_decoding_with_it(api, logit_bias):
    vanilla = grpc_complete(api, method="vanilla", logit_bias=logit_bias)
    assert vanilla.token_ids != grpc_complete(api, method="vanilla").token_ids      # the bias changed the output
    assert grpc_complete(api, logit_bias=logit_bias).token_ids == vanilla.token_ids
    json_bias = {str(t): b for t, b in logit_bias.items()}
    got = client(api).completions.create(model=api.model, prompt=PROMPT, max_tokens=N, temperature=0,
                                         logit_bias=json_bias, extra_body={"return_token_ids": True})
    assert got.choices[0].token_ids == vanilla.token_ids
    assert got.choices[0].specdec["cycles"] < N          # speculation was on
    chat_want = grpc_complete(api, prompt=None, messages=CHAT, method="vanilla", logit_bias=logit_bias)
    chat = client(api).chat.completions.create(model=api.model, messages=CHAT, max_tokens=N, temperature=0,
                                               logit_bias=json_bias)
    assert chat.choices[0].message.content == chat_want.text


def test_sampled_with_a_logit_bias_reproduces_the_sdk(api, logit_bias):
    want = grpc_complete(api, temperature=0.9, seed=11, logit_bias=logit_bias)
    got = client(api).completions.create(model=api.model, prompt=PROMPT, max_tokens=N, temperature=0.9, seed=11,
                                         logit_bias={str(t): b for t, b in logit_bias.items()},
                                         extra_body={"return_token_ids": True})
    assert got.choices[0].token_ids == want.token_ids


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": CHAT}),
])
def test_a_logit_bias_outside_the_vocabulary_is_a_400_naming_it(api, path, body):
    resp = httpx.post(api.root("eagle") + path, json={**body, "max_tokens": 4, "logit_bias": {"3": 1, "300": -5}},
                      timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "logit_bias"
    assert error["message"] == "logit_bias: token id 300 is outside the vocabulary [0, 300)"
    assert api.wait_closed() == {"verifier": 0, "drafter-eagle": 0}


def test_sampled_min_p_and_penalties_reproduce_the_sdk(api):
    want = grpc_complete(api, temperature=0.9, seed=7, min_p=0.05, **PENALTIES)
    got = client(api).completions.create(model=api.model, prompt=PROMPT, max_tokens=N, temperature=0.9, seed=7,
                                         frequency_penalty=0.8, presence_penalty=0.5,
                                         extra_body={"repetition_penalty": 1.3, "min_p": 0.05,
                                                     "return_token_ids": True})
    assert got.choices[0].token_ids == want.token_ids


def test_completion_logprobs_equal_the_sdks(api):
    want = grpc_complete(api, logprobs=3, repetition_penalty=1.2)
    got = client(api).completions.create(model=api.model, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=3,
                                         extra_body={"repetition_penalty": 1.2, "return_token_ids": True})
    lp = got.choices[0].logprobs
    assert got.choices[0].token_ids == want.token_ids
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-6)
    assert lp.tokens == [token_text(api, e.token) for e in want.logprobs]
    for top, e in zip(lp.top_logprobs, want.logprobs):
        assert len(e.top_tokens) == 3
        assert top == pytest.approx({token_text(api, t): v for t, v in zip(e.top_tokens, e.top_logprobs)}, abs=1e-6)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(v <= 0.0 and math.isfinite(v) for v in lp.token_logprobs)


def test_completion_logprobs_stream_in_chunks(api):
    want = grpc_complete(api, logprobs=2)
    chunks = list(client(api).completions.create(model=api.model, prompt=PROMPT, max_tokens=N, temperature=0,
                                                 logprobs=2, stream=True))
    tokens, logprobs, offsets = [], [], []
    for chunk in chunks:
        lp = chunk.choices[0].logprobs
        if lp is not None:
            tokens += lp.tokens
            logprobs += lp.token_logprobs
            offsets += lp.text_offset
    assert logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-6)
    assert tokens == [token_text(api, e.token) for e in want.logprobs]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_chat_logprobs_equal_the_sdks_over_the_same_template(api):
    want = grpc_complete(api, prompt=None, messages=CHAT, logprobs=4)
    got = client(api).chat.completions.create(model=api.model, messages=CHAT, max_tokens=N, temperature=0,
                                              logprobs=True, top_logprobs=4)
    content = got.choices[0].logprobs.content
    assert got.choices[0].message.content == want.text
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-6)
    for c, e in zip(content, want.logprobs):
        assert c.token == token_text(api, e.token) and c.bytes == list(c.token.encode())
        assert [t.token for t in c.top_logprobs] == [token_text(api, t) for t in e.top_tokens]
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(list(e.top_logprobs), abs=1e-6)
    streamed = list(client(api).chat.completions.create(model=api.model, messages=CHAT, max_tokens=N,
                                                        temperature=0, logprobs=True, stream=True))
    lps = [c.logprob for ch in streamed if ch.choices[0].logprobs is not None
           for c in ch.choices[0].logprobs.content]
    assert lps == pytest.approx([e.logprob for e in want.logprobs], abs=1e-6)
    plain = client(api).chat.completions.create(model=api.model, messages=CHAT, max_tokens=N, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == want.text


def test_n_choices_with_logprobs_each_match_the_sdk(api):
    want = grpc_complete(api, temperature=1.0, seed=5, n=3, logprobs=1, presence_penalty=0.5)
    got = client(api).completions.create(model=api.model, prompt=PROMPT, max_tokens=N, temperature=1.0, seed=5,
                                         n=3, logprobs=1, presence_penalty=0.5, extra_body={"return_token_ids": True})
    assert [c.index for c in got.choices] == [0, 1, 2]
    for choice, sdk_choice in zip(got.choices, want.choices):
        assert choice.token_ids == sdk_choice.token_ids
        assert choice.logprobs.token_logprobs == pytest.approx([e.logprob for e in sdk_choice.logprobs], abs=1e-6)
