"""Structured output through the services and the HTTP API with the official
``openai`` client: response_format json_schema / json_object, the vLLM-named
extras, tools with a named tool_choice (tool_calls, streamed too); greedy
constrained output with the EAGLE drafter equals plain constrained decoding
over gRPC; bad values are 400s naming the parameter."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from specdec.client import SpecdecClient

SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "color": {"enum": ["red", "green", "blue"]}}, "required": ["ok", "n", "color"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the forecast", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
OTHER = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}
MESSAGES = [{"role": "user", "content": "The weather?"}]
N = 64


def post(api, body: dict) -> httpx.Response:
    return httpx.post(api.url("eagle") + "/chat/completions", json=body, timeout=60)


def client(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.url("eagle"), api_key="unused", max_retries=0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_response_format_json_schema(api, temperature):
    got = client(api).chat.completions.create(
        model=api.model, messages=MESSAGES, max_tokens=N, temperature=temperature, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}})
    (choice,) = got.choices
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_response_format_json_object_streamed(api):
    chunks = list(client(api).chat.completions.create(model=api.model, messages=MESSAGES, max_tokens=N,
                                                      temperature=0, stream=True,
                                                      response_format={"type": "json_object"}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert isinstance(json.loads(text), dict)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_named_tool_call(api, choice):
    tools = [WEATHER] if choice == "required" else [OTHER, WEATHER]
    got = client(api).chat.completions.create(model=api.model, messages=MESSAGES, max_tokens=N, temperature=0,
                                              tools=tools, tool_choice=choice)
    (c,) = got.choices
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_streamed_tool_call_equals_the_whole(api):
    kw = dict(model=api.model, messages=MESSAGES, max_tokens=N, temperature=0, tools=[WEATHER],
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client(api).chat.completions.create(**kw).choices[0].message.tool_calls[0].function.arguments
    chunks = [ch for ch in client(api).chat.completions.create(stream=True, **kw) if ch.choices]
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    assert "".join(tc.function.arguments or "" for tc in calls) == whole
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_is_plain_text(api):
    c = client(api)
    plain = c.chat.completions.create(model=api.model, messages=MESSAGES, max_tokens=8, temperature=0)
    none = c.chat.completions.create(model=api.model, messages=MESSAGES, max_tokens=8, temperature=0,
                                     tools=[WEATHER], tool_choice="none")
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert not none.choices[0].message.tool_calls


@pytest.mark.parametrize("extra,check", [
    ({"guided_regex": r"(x[yz]|y[xz]){3}"}, lambda t: re.fullmatch(r"(x[yz]|y[xz]){3}", t)),
    ({"guided_grammar": 'start: "answer: " ("yes" | "no")'}, lambda t: t in ("answer: yes", "answer: no")),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"structured_outputs": {"regex": "[ab]{4}"}}, lambda t: re.fullmatch("[ab]{4}", t)),
])
def test_extras_on_completions(api, extra, check):
    got = client(api).completions.create(model=api.model, prompt="def add(a, b):", max_tokens=N, temperature=0,
                                         extra_body=extra)
    assert got.choices[0].finish_reason == "stop"
    assert check(got.choices[0].text)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_equals_plain_constrained_decoding_over_grpc(api, temperature):
    """The HTTP API (EAGLE drafter) against the SDK with method vanilla: the
    same tokens greedy, and with a seed (the same seeded choice either way)."""
    prompt = "for i in range(10):"
    got = client(api).completions.create(model=api.model, prompt=prompt, max_tokens=N, temperature=temperature,
                                         seed=5, extra_body={"guided_json": SCHEMA, "return_token_ids": True})
    with SpecdecClient(api.stack.address("eagle"), timeout=60) as sdk:
        plain = sdk.complete(prompt, max_new_tokens=N, method="vanilla", json_schema=SCHEMA, temperature=temperature,
                             seed=5)
        speculative = sdk.complete(prompt, max_new_tokens=N, json_schema=SCHEMA, temperature=temperature, seed=5,
                                   n=2, logprobs=1)
    if temperature == 0.0:
        assert got.choices[0].token_ids == plain.token_ids
        assert got.choices[0].specdec["tau"] > 1.0
    jsonschema.validate(json.loads(plain.text), SCHEMA)
    for choice in speculative.choices:
        jsonschema.validate(json.loads(choice.text), SCHEMA)
        assert len(choice.logprobs) == len(choice.token_ids)


BAD = [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "minLength": 3, "maxLength": 1}}}}, "response_format"),
    ({"tools": [WEATHER]}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER, OTHER], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": [{"type": "function"}], "tool_choice": "none"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ({"guided_json": "{broken"}, "guided_json"),
    ({"guided_regex": "a", "guided_grammar": 'start: "a"'}, "guided_regex"),
    ({"structured_outputs": {"xml": "x"}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_json": "[" * 50_000 + "]" * 50_000}, "guided_json"),
]


@pytest.mark.parametrize("fields,param", BAD)
def test_bad_structured_output_parameters_are_400(api, fields, param):
    body = {"messages": MESSAGES, "max_tokens": 4, **fields}
    resp = post(api, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert param in error["message"], error


def test_a_verifier_without_a_tokenizer_is_a_clear_400(api):
    servicer = api.stack.servicer("verifier")
    engine = servicer.engine
    saved, engine.grammar_tokenizer = engine.grammar_tokenizer, None
    try:
        resp = httpx.post(api.url("eagle") + "/completions", timeout=30, json={
            "prompt": "x", "max_tokens": 4, "guided_regex": "[ab]+"})
    finally:
        engine.grammar_tokenizer = saved
    assert resp.status_code == 400 and "tokenizer" in resp.json()["error"]["message"]
