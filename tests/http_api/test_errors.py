"""Errors as OpenAI's JSON with the right status, and cancellation: 400 naming
each bad parameter, 401, 404, 429, 503, 504; a client that disconnects
frees both sessions."""

from __future__ import annotations

import json
import socket
import threading
from contextlib import contextmanager

import httpx
import openai
import pytest

from http_api.helpers import TOKEN, wait_until
from serving.helpers import SessionWatch, channel_to
from specdec.v1.common_pb2 import SamplingParams
from specdec.v1.verifier_pb2 import VerifierPrefillRequest, VerifierReleaseRequest
from specdec.v1.verifier_pb2_grpc import VerifierServiceStub
from running_stack import Tap

LONG = {"prompt": "class Point:", "max_tokens": 400, "temperature": 0}
BACKENDS = ("verifier", "drafter-eagle")


def post(api, path: str, body: dict, server: str = "eagle", headers: dict | None = None) -> httpx.Response:
    # json.dumps writes inf as Infinity, which Python's parser (and so the server's) reads back
    return httpx.post(api.root(server) + path, content=json.dumps(body), timeout=60,
                      headers={"content-type": "application/json", **(headers or {})})


def assert_error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param, body
    assert body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


BAD_COMPLETIONS = [
    ({"temperature": -1}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens"), ({"max_completion_tokens": 5000}, "max_completion_tokens"),
    ({"max_tokens": "many"}, "max_tokens"), ({"n": 0}, "n"), ({"n": 17}, "n"),
    ({"stop": [""]}, "stop"), ({"stop": ["s"] * 17}, "stop"), ({"stop": 5}, "stop"), ({"prompt": ""}, "prompt"),
    ({"prompt": [1, 2, 3]}, "prompt"), ({"prompt": "x" * 4000, "max_tokens": 8}, "prompt"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"presence_penalty": -3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"), ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logit_bias": {"x": 10}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"), ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": "much"}}, "logit_bias"), ({"logit_bias": {"5": 1, "05": 2}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"echo": True, "stream": True}, "echo"), ({"echo": True, "max_tokens": 0, "n": 2}, "n"),
    ({"max_tokens": 0, "logprobs": 2}, "max_tokens"), ({"suffix": "x"}, "suffix"),
    ({"best_of": 3}, "best_of"), ({"stream": "maybe"}, "stream"),
]


@pytest.mark.parametrize("fields,param", BAD_COMPLETIONS)
def test_each_bad_completion_parameter_is_named(api, fields, param):
    body = {"prompt": "def add(a, b):", "max_tokens": 4, **fields}
    error = assert_error(post(api, "/v1/completions", body), 400, param)
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(param) or param in error["message"]


BAD_CHATS = [
    ({"messages": []}, "messages"), ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}, "messages"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),     # "auto": not supported
    ({"response_format": {"type": "xml"}}, "response_format"), ({"temperature": -0.5}, "temperature"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"), ({"logit_bias": {"7": -100.5}}, "logit_bias"),
]


@pytest.mark.parametrize("fields,param", BAD_CHATS)
def test_each_bad_chat_parameter_is_named(api, fields, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    assert_error(post(api, "/v1/chat/completions", body), 400, param)


def test_malformed_json_is_400(api):
    resp = httpx.post(api.root("eagle") + "/v1/completions", content=b"{not json", timeout=10,
                      headers={"content-type": "application/json"})
    assert_error(resp, 400, None)


def test_a_template_refusing_the_conversation_is_400(api, tmp_path):
    from orchestrator.chat_template import ChatTemplate

    template = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
                            "{{ messages[0].content }}", {}, "test")
    api.serve("strict", "eagle", chat_template=template)
    try:
        resp = post(api, "/v1/chat/completions", {"messages": [{"role": "system", "content": "x"}]}, server="strict")
        assert "user first" in assert_error(resp, 400, "messages")["message"]
    finally:
        api.stop("strict")


def test_chat_without_a_template_is_400(api):
    resp = post(api, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, server="plain")
    assert "--chat-template" in assert_error(resp, 400, "messages")["message"]


def test_unknown_model_is_404(api):
    error = assert_error(post(api, "/v1/completions", {"prompt": "x", "model": "gpt-9"}), 404, "model",
                         "model_not_found")
    assert "gpt-9" in error["message"]
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=api.url("eagle"), api_key="x", max_retries=0).chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "x"}])


def test_bearer_token(api):
    body = {"prompt": "x", "max_tokens": 2}
    assert_error(post(api, "/v1/completions", body, server="auth"), 401, None, "invalid_api_key")
    assert_error(post(api, "/v1/completions", body, server="auth", headers={"authorization": "Bearer nope"}), 401)
    assert httpx.get(api.root("auth") + "/v1/models", timeout=10).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=api.url("auth"), api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=api.url("auth"), api_key=TOKEN, max_retries=0)
    # greedy: OpenAI's default temperature (1) may draw the tiny model's end of text as the second token
    got = good.completions.create(model=api.model, prompt="x", max_tokens=2, temperature=0)
    assert got.usage.completion_tokens == 2 and got.choices[0].finish_reason == "length"
    assert httpx.get(api.root("auth") + "/health", timeout=10).status_code == 200    # probes need no token


def test_past_the_request_timeout_is_504_and_frees_the_sessions(api):
    """A generation held at its third verify past the request timeout (2 s:
    time enough to open both sessions however loaded the machine): 504, and
    both sessions it opened are released, the generation cut short."""
    watch = SessionWatch(api.stack, *BACKENDS)
    api.serve("timeout-2s", "eagle", timeout_s=2.0)
    try:
        with prefills_tapped(api) as opened, verifies_held(api, after=2) as tap:
            error = assert_error(post(api, "/v1/completions", LONG, server="timeout-2s"), 504, None, "timeout")
            assert error["type"] == "server_error"
            assert {name: len(sids) for name, sids in opened.items()} == {"verifier": 1, "drafter-eagle": 1}
            assert tap.held == 1                        # the generation was still running
            tap.open()
        assert_left_early(api, tap, watch)
    finally:
        api.stop("timeout-2s")


def test_at_capacity_is_429(api):
    """A verifier whose one session slot is held (by a session opened on it
    directly): generations answer 429, streamed or not."""
    stack = api.stack
    stack.add_verifier("small-verifier", max_sessions=1)
    stack.add_orchestrator("small", verifier="small-verifier")
    api.serve("small", "small")

    async def hold(release: bool):
        async with channel_to(stack.servers["small-verifier"][0]) as channel:
            stub = VerifierServiceStub(channel)
            if release:
                await stub.Release(VerifierReleaseRequest(session_id="held"))
            else:
                await stub.Prefill(VerifierPrefillRequest(session_id="held", prompt_ids=[5, 6, 7],
                                                          sampling=SamplingParams(seed=1), max_new_tokens=8))
    try:
        stack.loop.run(hold(release=False))
        assert stack.open_sessions("small-verifier") == {"small-verifier": 1}
        error = assert_error(post(api, "/v1/completions", {"prompt": "x", "max_tokens": 4}, server="small"),
                             429, None, "rate_limit_exceeded")
        assert error["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=api.url("small"), api_key="x", max_retries=0).completions.create(
                model=api.model, prompt="x", max_tokens=4, stream=True)
        stack.loop.run(hold(release=True))
        assert post(api, "/v1/completions", {"prompt": "x", "max_tokens": 4}, server="small").status_code == 200
    finally:
        api.stop("small")
        stack.stop("small")
        stack.stop("small-verifier")


def test_not_ready_and_draining_are_503(api):
    stack = api.stack
    stack.add_orchestrator("cold", verifier="127.0.0.1:1", connect=False)
    api.serve("cold", "cold")
    try:
        assert_error(post(api, "/v1/completions", {"prompt": "x"}, server="cold"), 503, None, "unavailable")
        assert_error(httpx.get(api.root("cold") + "/health", timeout=10), 503)
        assert httpx.get(api.root("cold") + "/health/live", timeout=10).status_code == 200
    finally:
        api.stop("cold")
        stack.stop("cold")
    lifecycle = stack.servicer("eagle").lifecycle
    lifecycle.draining = True
    try:
        error = assert_error(post(api, "/v1/completions", {"prompt": "x", "max_tokens": 2}), 503, None)
        assert "draining" in error["message"]
        assert httpx.get(api.root("eagle") + "/health", timeout=10).status_code == 503
    finally:
        lifecycle.draining = False
    assert httpx.get(api.root("eagle") + "/health", timeout=10).json() == {"status": "ok"}


@contextmanager
def verifies_held(api, after: int):
    """The verifier lets ``after`` more verifies through, then holds the rest
    until the block ends: a generation stays open, however fast the models;
    yields the tap (its ``sessions``: one entry per verify called)."""
    tap = Tap(api.stack.servicer("verifier").engine, "verify")
    tap.close(after=after)
    try:
        yield tap
    finally:
        tap.restore()


@contextmanager
def prefills_tapped(api):
    """Yields {backend: ids of the sessions opened on it} (its prefills) until the block ends."""
    stack = api.stack
    taps = {"verifier": Tap(stack.servicer("verifier").engine, "prefill"),
            "drafter-eagle": Tap(stack.servicer("drafter-eagle").drafter, "prefill")}
    try:
        yield {name: tap.sessions for name, tap in taps.items()}
    finally:
        for tap in taps.values():
            tap.restore()


def assert_left_early(api, tap, watch: SessionWatch) -> None:
    """Both sessions released (not left to lapse), with the generation cut
    short: far fewer verifies than its 400 tokens would take."""
    assert watch.released() == {"verifier": 0, "drafter-eagle": 0}
    assert wait_until(lambda: api.stack.servicer("eagle").active == 0)
    assert len(tap.sessions) < 20


def assert_held_mid_generation(api, tap, rest=lambda: b"") -> None:
    """The generation is under way and stays so: its third verify waits at
    the tap (a generous wait: a loaded machine can take seconds to get there)
    with both its sessions open. A generation that ended first fails with what
    it answered (``rest()``: the rest of its stream), not just the counts."""
    if not wait_until(lambda: tap.held == 1, timeout=60):
        counts = api.stack.open_sessions(*BACKENDS)
        tap.open()
        pytest.fail(f"the generation never reached its third verify ({len(tap.sessions)} verifies, open "
                    f"sessions {counts}); what it answered after its first chunk: {rest()[-2000:]!r}")
    assert api.stack.open_sessions(*BACKENDS) == {"verifier": 1, "drafter-eagle": 1}


def test_a_client_leaving_a_stream_frees_both_sessions(api):
    watch = SessionWatch(api.stack, *BACKENDS)
    with verifies_held(api, after=2) as tap:
        with httpx.stream("POST", api.root("eagle") + "/v1/completions", json={**LONG, "stream": True},
                          timeout=60) as resp:
            assert resp.status_code == 200
            chunks = resp.iter_raw()
            next(chunks)
            assert_held_mid_generation(api, tap, rest=lambda: b"".join(chunks))
        tap.open()                          # the held verify returns to a cancelled request
        assert_left_early(api, tap, watch)


def test_a_client_leaving_a_whole_request_frees_both_sessions(api):
    """No stream: nothing is written until the end, so the server must watch
    the connection itself."""
    host, port = api.root("eagle").removeprefix("http://").split(":")
    body = json.dumps(LONG).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    watch = SessionWatch(api.stack, *BACKENDS)
    with verifies_held(api, after=2) as tap:
        sock = socket.create_connection((host, int(port)))
        try:
            sock.sendall(head + body)
            assert_held_mid_generation(api, tap)
        finally:
            sock.close()
        tap.open()
        assert_left_early(api, tap, watch)


def test_concurrent_streams_leaving_free_every_session(api):
    """Two clients, two choices each: all four sessions open on each backend
    before the clients leave, then every one is released, the generations cut
    short (one choice of 400 tokens takes about 400 verifies here, four 1600)."""
    watch = SessionWatch(api.stack, *BACKENDS)
    read_first, leave = threading.Barrier(3, timeout=60), threading.Event()

    def client():
        with httpx.stream("POST", api.root("eagle") + "/v1/completions", json={**LONG, "stream": True, "n": 2},
                          timeout=60) as resp:
            chunks = resp.iter_raw()                # (held: dropping the iterator closes the response)
            next(chunks)
            read_first.wait()
            leave.wait(60)

    verifies = Tap(api.stack.servicer("verifier").engine, "verify")
    try:
        with prefills_tapped(api) as opened:
            threads = [threading.Thread(target=client) for _ in range(2)]
            for t in threads:
                t.start()
            try:
                read_first.wait()
                assert watch.opened(count=4) == {"verifier": 4, "drafter-eagle": 4}
            finally:
                leave.set()
                for t in threads:
                    t.join(60)
            assert watch.released() == {"verifier": 0, "drafter-eagle": 0}
        assert {name: len(set(sids)) for name, sids in opened.items()} == {"verifier": 4, "drafter-eagle": 4}
        assert len(verifies.sessions) < 400
    finally:
        verifies.restore()
