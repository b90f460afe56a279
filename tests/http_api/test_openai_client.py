"""The official ``openai`` client against the HTTP API: sync and async, streaming
and not, completions and chat; the same tokens as the SDK over gRPC."""

from __future__ import annotations

import asyncio

import openai
import pytest

from http_api.helpers import CHAT_TEMPLATE
from specdec.client import SpecdecClient
from specdec.request.params import choice_seed

PROMPTS = ["def add(a, b):", "for i in range(3):\n"]
N = 24


def client(api, name: str = "eagle", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.url(name), api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


def grpc_complete(api, prompt: str, **params):
    with SpecdecClient(api.stack.address("eagle"), timeout=60) as sdk:
        return sdk.complete(prompt, max_new_tokens=N, **params)


@pytest.mark.parametrize("params", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 11},
                                    {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 3}])
def test_completion_matches_the_sdk_over_grpc(api, params):
    c = client(api)
    for prompt in PROMPTS:
        want = grpc_complete(api, prompt, **params)
        openai_params = {k: v for k, v in params.items() if k != "top_k"}    # top_k: vLLM's extra
        extra = {"return_token_ids": True, **({"top_k": params["top_k"]} if "top_k" in params else {})}
        got = c.completions.create(model=api.model, prompt=prompt, max_tokens=N, extra_body=extra, **openai_params)
        (choice,) = got.choices
        assert choice.token_ids == want.token_ids
        assert choice.text == want.text
        assert choice.finish_reason == "length"
        assert got.object == "text_completion" and got.model == api.model and got.id.startswith("cmpl-")
        assert got.usage.completion_tokens == N == want.stats.completion_tokens
        assert got.usage.prompt_tokens == want.stats.prompt_tokens
        assert got.usage.total_tokens == got.usage.prompt_tokens + N
        stats = choice.specdec
        assert stats["completion_tokens"] == N and stats["cycles"] >= 1 and stats["tau"] >= 1.0
        if "seed" not in params:       # greedy: the same trees, so the same acceptance
            assert stats["accepted_per_position"] == list(want.stats.accepted_per_position)


@pytest.mark.parametrize("params", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 5}])
def test_streamed_completion_equals_the_whole(api, params):
    c = client(api)
    whole = c.completions.create(model=api.model, prompt=PROMPTS[0], max_tokens=N, **params)
    chunks = list(c.completions.create(model=api.model, prompt=PROMPTS[0], max_tokens=N, stream=True,
                                       stream_options={"include_usage": True}, **params))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    # (a sampled one may end at an end-of-text token before N: the stream ends as the whole did)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert whole.choices[0].finish_reason == "length" or "seed" in params
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])
    assert len({ch.id for ch in chunks}) == 1 and {ch.object for ch in chunks} == {"text_completion"}


def test_chat_renders_the_template_and_matches_the_prompt(api):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]
    rendered = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + "<|assistant|>"
    assert CHAT_TEMPLATE.startswith("{{ bos_token }}")
    c = client(api)
    chat = c.chat.completions.create(model=api.model, messages=messages, max_tokens=N, temperature=0,
                                     extra_body={"return_token_ids": True})
    want = grpc_complete(api, chat_prompt(api, rendered))
    (choice,) = chat.choices
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.token_ids == want.token_ids
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    assert chat.usage.prompt_tokens == want.stats.prompt_tokens
    # content as a list of text parts is the same conversation
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    again = c.chat.completions.create(model=api.model, messages=parts, max_tokens=N, temperature=0)
    assert again.choices[0].message.content == choice.message.content


def chat_prompt(api, rendered: str) -> str:
    """What the server encodes for a rendered chat: the template's BOS text first
    (the tiny tokenizer adds no BOS of its own)."""
    assert api.stack.servicer("eagle").tokenizer.encode("") == []
    bos = api.http["eagle"].config.chat_template.special_tokens["bos_token"]
    assert bos
    return bos + rendered


def test_streamed_chat(api):
    c = client(api)
    messages = [{"role": "user", "content": "class Point:"}]
    whole = c.chat.completions.create(model=api.model, messages=messages, max_tokens=N, temperature=0)
    chunks = list(c.chat.completions.create(model=api.model, messages=messages, max_tokens=N, temperature=0,
                                            stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].object == "chat.completion.chunk"
    assert chunks[-1].choices[0].specdec["completion_tokens"] == N


def test_async_client_concurrent_requests(api):
    async def main():
        c = openai.AsyncOpenAI(base_url=api.url("eagle"), api_key="unused", max_retries=0)
        whole = c.completions.create(model=api.model, prompt=PROMPTS[1], max_tokens=N, temperature=0)

        async def streamed():
            stream = await c.completions.create(model=api.model, prompt=PROMPTS[1], max_tokens=N, temperature=0,
                                                stream=True)
            return "".join([ch.choices[0].text async for ch in stream if ch.choices])

        chat = c.chat.completions.create(model=api.model, messages=[{"role": "user", "content": "x"}],
                                         max_tokens=8, temperature=0)
        a, b, ch = await asyncio.gather(whole, streamed(), chat)
        await c.close()
        return a, b, ch

    a, b, ch = asyncio.run(main())
    assert a.choices[0].text == b == grpc_complete(api, PROMPTS[1]).text
    assert ch.usage.completion_tokens <= 8


def test_n_choices_reproduce_with_derived_seeds(api):
    c = client(api)
    got = c.completions.create(model=api.model, prompt=PROMPTS[0], max_tokens=N, temperature=1.0, seed=40, n=3,
                               extra_body={"return_token_ids": True})
    assert [ch.index for ch in got.choices] == [0, 1, 2]
    for i, choice in enumerate(got.choices):       # choice i samples with choice_seed(seed, i), as over gRPC
        assert choice.token_ids == grpc_complete(api, PROMPTS[0], temperature=1.0,
                                                 seed=choice_seed(40, i)).token_ids
    assert len({tuple(ch.token_ids) for ch in got.choices}) > 1
    assert got.usage.completion_tokens == 3 * N
    assert got.usage.prompt_tokens == got.choices[0].specdec["prompt_tokens"]     # the prompt counted once
    streamed = list(c.completions.create(model=api.model, prompt=PROMPTS[0], max_tokens=N, temperature=1.0,
                                         seed=40, n=3, stream=True))
    for i, choice in enumerate(got.choices):
        assert "".join(ch.choices[0].text for ch in streamed if ch.choices[0].index == i) == choice.text


def test_several_prompts_in_one_completion(api):
    got = client(api).completions.create(model=api.model, prompt=PROMPTS, max_tokens=N, temperature=0, n=2)
    texts = [grpc_complete(api, p).text for p in PROMPTS]
    assert [ch.text for ch in got.choices] == [texts[0], texts[0], texts[1], texts[1]]


def test_stop_strings_finish_with_stop(api):
    c = client(api)
    full = grpc_complete(api, PROMPTS[0]).text
    stop = full[5:7]
    assert stop and full.find(stop) >= 0
    got = c.completions.create(model=api.model, prompt=PROMPTS[0], max_tokens=N, temperature=0, stop=stop)
    assert got.choices[0].text == full[:full.find(stop)]
    assert got.choices[0].finish_reason == "stop"
    as_list = c.completions.create(model=api.model, prompt=PROMPTS[0], max_tokens=N, temperature=0,
                                   stop=["\u2603never", stop])
    assert as_list.choices[0].text == got.choices[0].text


def test_max_completion_tokens_and_neutral_extras(api):
    c = client(api)
    got = c.chat.completions.create(model=api.model, messages=[{"role": "user", "content": "x"}], temperature=0,
                                    max_completion_tokens=5, frequency_penalty=0, presence_penalty=0,
                                    extra_body={"repetition_penalty": 1.0, "min_p": 0.0, "top_k": -1,
                                                "an_unknown_field": [1, 2]})
    assert got.usage.completion_tokens == 5 and got.choices[0].finish_reason == "length"


def test_models_and_health(api):
    c = client(api)
    (model,) = c.models.list().data
    assert model.id == api.model and model.object == "model" and model.owned_by == "specdec"
    assert c.models.retrieve(api.model).id == api.model
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("no-such-model")
