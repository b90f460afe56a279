"""Server-sent events byte for byte (raw httpx, no client library in between)."""

from __future__ import annotations

import json
import re

import httpx

from serving.helpers import SessionWatch

N = 12
EVENT = re.compile(rb"data: ([^\n]*)\n\n")


def events(raw: bytes) -> list[bytes]:
    """The payloads of ``raw``, which must be nothing but ``data: <payload>\\n\\n`` events."""
    payloads, at = [], 0
    while at < len(raw):
        m = EVENT.match(raw, at)
        assert m, f"not an SSE event at byte {at}: {raw[at:at + 80]!r}"
        payloads.append(m.group(1))
        at = m.end()
    return payloads


def compact(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def stream(api, path: str, body: dict) -> tuple[httpx.Response, bytes]:
    with httpx.stream("POST", api.root("eagle") + path, json=body, timeout=60) as resp:
        return resp, resp.read()


def check_framing(payloads: list[bytes]) -> list[dict]:
    assert payloads[-1] == b"[DONE]"
    objs = [json.loads(p) for p in payloads[:-1]]
    assert [compact(o) for o in objs] == payloads[:-1], "each event is one compact JSON object"
    assert len({(o["id"], o["created"], o["model"]) for o in objs}) == 1
    return objs


def test_completion_stream_bytes(api):
    resp, raw = stream(api, "/v1/completions", {"prompt": "def add(a, b):", "max_tokens": N, "temperature": 0,
                                                "stream": True, "stream_options": {"include_usage": True}})
    assert resp.status_code == 200
    assert resp.headers["content-type"].split(";")[0] == "text/event-stream"
    assert raw.endswith(b"\n\ndata: [DONE]\n\n") and raw.startswith(b"data: {")
    objs = check_framing(events(raw))
    *chunks, last, usage = objs
    assert {o["object"] for o in objs} == {"text_completion"}
    for o in chunks:
        assert set(o) == {"id", "object", "created", "model", "choices", "usage"} and o["usage"] is None
        (choice,) = o["choices"]
        assert choice == {"index": 0, "text": choice["text"], "logprobs": None, "finish_reason": None}
        assert choice["text"]
    (final,) = last["choices"]
    assert final["finish_reason"] == "length" and final["text"] == "" and final["specdec"]["completion_tokens"] == N
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == N
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + N
    whole = httpx.post(api.root("eagle") + "/v1/completions",
                       json={"prompt": "def add(a, b):", "max_tokens": N, "temperature": 0}, timeout=60).json()
    assert "".join(o["choices"][0]["text"] for o in chunks) == whole["choices"][0]["text"]


def test_chat_stream_bytes_without_usage(api):
    resp, raw = stream(api, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": N, "temperature": 0, "stream": True})
    assert resp.status_code == 200
    objs = check_framing(events(raw))
    assert {o["object"] for o in objs} == {"chat.completion.chunk"}
    assert all("usage" not in o for o in objs)
    first, *deltas, last = objs
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]
    assert all(set(o["choices"][0]["delta"]) == {"content"} for o in deltas)
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"


def test_error_before_the_first_token_keeps_its_status(api):
    resp, raw = stream(api, "/v1/completions", {"prompt": "x", "max_tokens": 5000, "stream": True})
    assert resp.status_code == 400
    assert json.loads(raw)["error"]["param"] == "max_tokens"


def test_an_error_after_the_first_token_is_an_event(api):
    """Headers are out with the first text: a later failure (here the server's
    0.3 s request timeout) is an error event, then [DONE]."""
    body = {"prompt": "class Point:", "max_tokens": 400, "temperature": 0, "stream": True}
    watch = SessionWatch(api.stack, "verifier", "drafter-eagle")
    with httpx.stream("POST", api.root("timeout") + "/v1/completions", json=body, timeout=60) as resp:
        raw = resp.read()
    assert resp.status_code == 200
    payloads = events(raw)
    assert payloads[-1] == b"[DONE]"
    error = json.loads(payloads[-2])
    assert set(error) == {"error"} and error["error"]["code"] == "timeout" and error["error"]["type"] == "server_error"
    assert all("choices" in json.loads(p) for p in payloads[:-2])
    assert watch.released() == {"verifier": 0, "drafter-eagle": 0}
