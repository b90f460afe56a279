"""The OpenAI request -> GenerationRequest mapping, without a server."""

from __future__ import annotations

import pytest

from specdec.request.errors import InvalidArgument
from specdec.request.params import TokenLogprob
from orchestrator import openai_schema as schema


def completion(**fields) -> schema.CompletionRequest:
    return schema.CompletionRequest(prompt="x", **fields)


def test_defaults_follow_openai():
    req = schema.generation_request(completion(), "x", "rid")
    assert req.sampling.temperature == 1.0 and req.sampling.top_p == 1.0 and req.sampling.top_k == 0
    assert req.sampling.seed is None and req.max_new_tokens == 0 and req.stop == () and req.request_id == "rid"


def test_fields_map_one_to_one():
    req = schema.generation_request(completion(temperature=0.5, top_p=0.9, top_k=7, seed=3, stop="\n",
                                               max_completion_tokens=9), "p")
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.top_k, req.sampling.seed) == (0.5, 0.9, 7, 3)
    assert req.stop == ("\n",) and req.max_new_tokens == 9 and req.prompt == "p"
    assert schema.generation_request(completion(top_k=-1), "p").sampling.top_k == 0
    with pytest.raises(InvalidArgument, match="disagree"):
        schema.generation_request(completion(max_tokens=3, max_completion_tokens=4), "p")


def test_penalties_logprobs_and_n_map_to_the_request():
    req = schema.generation_request(completion(frequency_penalty=0.5, presence_penalty=-1.0, repetition_penalty=1.2,
                                               min_p=0.1, logprobs=3, n=2), "p")
    s = req.sampling
    assert (s.frequency_penalty, s.presence_penalty, s.repetition_penalty, s.min_p) == (0.5, -1.0, 1.2, 0.1)
    assert req.logprobs == 3 and req.n == 2
    plain = schema.generation_request(completion(), "p")
    assert (plain.sampling.repetition_penalty, plain.sampling.min_p, plain.logprobs, plain.n) == (1.0, 0.0, None, 1)
    chat = schema.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True)
    assert schema.generation_request(chat, "p").logprobs == 0
    assert schema.generation_request(chat.model_copy(update={"top_logprobs": 5}), "p").logprobs == 5
    unasked = schema.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    assert schema.generation_request(unasked, "p").logprobs is None


def test_logit_bias_keys_become_token_ids():
    req = schema.generation_request(completion(logit_bias={"50": 2, " 7": -100, "0": 0.5}), "p")
    assert req.sampling.logit_bias == ((0, 0.5), (7, -100), (50, 2))
    chat = schema.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logit_bias={"3": 1.0})
    assert schema.generation_request(chat, "p").sampling.logit_bias == ((3, 1.0),)
    for bad in ({"a": 1.0}, {"1.5": 1.0}, {"": 1.0}, {"3": 1.0, "003": 2.0}):
        with pytest.raises(InvalidArgument, match="^logit_bias: "):
            schema.generation_request(completion(logit_bias=bad), "p")
    assert schema.openai_param("sampling.logit_bias[3] must be in [-100, 100], got 101", None) == (
        "logit_bias", "logit_bias[3] must be in [-100, 100], got 101")


def test_echo_maps_to_prompt_logprobs_and_max_tokens_0_to_prompt_only():
    scored = schema.generation_request(completion(echo=True, logprobs=2, max_tokens=0), "p")
    assert (scored.prompt_only, scored.prompt_logprobs, scored.logprobs, scored.max_new_tokens) == (True, 2, 2, 0)
    echoed = schema.generation_request(completion(echo=True, max_tokens=5), "p")
    assert (echoed.prompt_only, echoed.prompt_logprobs, echoed.max_new_tokens) == (False, None, 5)
    assert schema.generation_request(completion(logprobs=2), "p").prompt_logprobs is None
    with pytest.raises(InvalidArgument, match="^max_tokens must be >= 1, got 0"):
        schema.generation_request(completion(max_tokens=0), "p")


def test_echoed_completion_logprobs_start_with_the_prompt():
    text = {1: "a", 2: "bc", 3: "d", 4: "e"}.__getitem__
    prompt = ([1, 2], [TokenLogprob(2, -0.5, (3,), (-0.25,))])
    body = schema.completion_logprobs([TokenLogprob(4, -1.0, (4,), (-1.0,))], text, prompt=prompt)
    assert body == {"tokens": ["a", "bc", "e"], "token_logprobs": [None, -0.5, -1.0],
                    "top_logprobs": [None, {"d": -0.25}, {"e": -1.0}], "text_offset": [0, 1, 3]}


@pytest.mark.parametrize("message,param,rewritten", [
    ("sampling.top_p must be in (0, 1], got 1.5", "top_p", "top_p must be in (0, 1], got 1.5"),
    ("max_new_tokens must be <= 2048, got 5000", "max_tokens", "max_tokens must be <= 2048, got 5000"),
    ("stop[0] must not be empty", "stop", "stop[0] must not be empty"),
    ("prompt is too long: 9 tokens", "prompt", "prompt is too long: 9 tokens"),
    ("something else went wrong", None, "something else went wrong"),
])
def test_messages_name_the_openai_parameter(message, param, rewritten):
    assert schema.openai_param(message, completion()) == (param, rewritten)


def test_chat_names_messages_and_max_completion_tokens():
    chat = schema.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_completion_tokens=5000)
    assert schema.openai_param("prompt must not be empty", chat)[0] == "messages"
    assert schema.openai_param("max_new_tokens must be <= 2048", chat)[0] == "max_completion_tokens"
