"""The OpenAI request -> GenerationRequest mapping, without a server."""

from __future__ import annotations

import pytest

from orchestrator import openai_schema as schema
from specdec.errors import InvalidArgument
from specdec.params import MAX_SEED


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


def test_choice_seeds_are_derived_and_wrap():
    first = schema.generation_request(completion(seed=MAX_SEED, temperature=1.0), "p")
    seeds = [r.sampling.seed for r in schema.choice_requests(first, 3)]
    assert seeds == [MAX_SEED, 0, 1]
    unseeded = schema.generation_request(completion(), "p")
    assert [r.sampling.seed for r in schema.choice_requests(unseeded, 2)] == [None, None]


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
