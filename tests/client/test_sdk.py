"""The client SDK against real servers: sync and async, cancellation by
closing or leaving a stream, retries before a stream starts, deadlines,
typed errors, TLS; and no torch in the SDK or the orchestrator."""

import asyncio
import subprocess
import sys
import time
from dataclasses import dataclass

import grpc
import pytest

from running_stack import Stack, Tap
from serving.helpers import SessionWatch
from specdec.client import (AsyncSpecdecClient, SpecdecClient, SpecdecClientError, SpecdecDeadlineExceeded,
                            SpecdecInvalidArgument, SpecdecUnavailable)
from specdec.serving.metrics import REGISTRY

PROMPT = "class Point:"
BACKENDS = ("verifier", "drafter")


@pytest.fixture(scope="module")
def stack(tiny_family):
    s = Stack(tiny_family)
    s.add_verifier("verifier")
    s.add_drafter("drafter", "eagle")
    s.add_orchestrator("orchestrator", drafter="drafter")
    s.add_orchestrator("waiting", verifier="127.0.0.1:1", connect=False)   # never ready: UNAVAILABLE
    yield s
    s.close()


def unavailable_calls(method: str, at_least: float = 0.0) -> float:
    """UNAVAILABLE answers the orchestrator counted (the count lands just after the answer)."""
    labels = {"service": "specdec.v1.OrchestratorService", "method": method, "code": "UNAVAILABLE"}
    deadline = time.monotonic() + 2.0
    while True:
        value = REGISTRY.get_sample_value("specdec_rpcs_total", labels) or 0.0
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.01)


def test_sync_and_async_give_the_same_result(stack):
    address = stack.address("orchestrator")
    with SpecdecClient(address) as client:
        whole = client.complete(PROMPT, max_new_tokens=20)
        stream = client.generate(PROMPT, max_new_tokens=20)
        chunks = list(stream)

    async def run_async():
        async with AsyncSpecdecClient(address) as client:
            result = await client.complete(PROMPT, max_new_tokens=20)
            stream = client.generate(PROMPT, max_new_tokens=20)
            got = [chunk async for chunk in stream]
            return result, stream, got

    a_whole, a_stream, a_chunks = asyncio.run(run_async())
    assert len(whole.token_ids) == 20 and whole.stats.completion_tokens == 20
    for result in (a_whole,):
        assert (result.token_ids, result.text) == (whole.token_ids, whole.text)
    for s, got in ((stream, chunks), (a_stream, a_chunks)):
        assert [t for c in got for t in c.token_ids] == whole.token_ids == s.token_ids
        assert "".join(c.text for c in got) == whole.text == s.text
        assert s.stats.completion_tokens == 20 and s.stats.cycles == whole.stats.cycles


class Dropped:
    """A 400-token stream to drop: its verifies are held after the second, so
    it cannot end by itself. ``opened()`` (after its first chunk) asserts both
    sessions open, the drafter's included (it may open after the first chunk);
    ``released()`` (after the drop) lets the verifies go and asserts both
    sessions released (not left for their lease to lapse), the generation cut
    short: far fewer verifies than its 400 tokens would take."""

    def __init__(self, stack):
        self.watch = SessionWatch(stack, *BACKENDS)
        self.tap = Tap(stack.servicer("verifier").engine, "verify")
        self.tap.close(after=2)

    def opened(self) -> None:
        assert self.watch.opened() == {"verifier": 1, "drafter": 1}

    def released(self) -> None:
        self.tap.open()
        assert self.watch.released() == {"verifier": 0, "drafter": 0}
        assert len(self.tap.sessions) < 20

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.tap.restore()


def test_closing_a_stream_cancels_the_call(stack):
    with SpecdecClient(stack.address("orchestrator")) as client:
        with Dropped(stack) as run:
            stream = client.generate(PROMPT, max_new_tokens=400)
            next(stream)
            run.opened()
            stream.close()
            run.released()
        assert list(stream) == [] and stream.stats is None

        with Dropped(stack) as run:
            for _ in client.generate(PROMPT, max_new_tokens=400):
                run.opened()
                break                                   # dropping the iterator cancels too
            run.released()

        with Dropped(stack) as run:
            with client.generate(PROMPT, max_new_tokens=400) as stream:
                next(stream)
                run.opened()
            run.released()


def test_async_stream_aclose_cancels_the_call(stack):
    async def run():
        async with AsyncSpecdecClient(stack.address("orchestrator")) as client:
            with Dropped(stack) as dropped:
                stream = client.generate(PROMPT, max_new_tokens=400)
                async for _ in stream:
                    break
                dropped.opened()
                await stream.aclose()
                await asyncio.to_thread(dropped.released)

    asyncio.run(run())


def test_retries_unavailable_before_the_stream_starts(stack):
    address = stack.address("waiting")
    for retries in (0, 2):
        with SpecdecClient(address, retries=retries, backoff_s=0.05) as client:
            for method, call in (("Generate", lambda: list(client.generate("x"))),
                                 ("Complete", lambda: client.complete("x"))):
                before = unavailable_calls(method)
                t0 = time.monotonic()
                with pytest.raises(SpecdecUnavailable) as err:
                    call()
                assert unavailable_calls(method, before + retries + 1) - before == retries + 1
                assert time.monotonic() - t0 >= 0.05 * (2 ** retries - 1)   # backoff 0.05, 0.1
                assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.details

    async def run_async():
        async with AsyncSpecdecClient(address, retries=1, backoff_s=0.01) as client:
            before = unavailable_calls("Generate")
            with pytest.raises(SpecdecUnavailable):
                async for _ in client.generate("x"):
                    pass
            assert unavailable_calls("Generate", before + 2) - before == 2
            with pytest.raises(SpecdecUnavailable):
                await client.complete("x")

    asyncio.run(run_async())


def test_retries_stop_at_the_deadline(stack):
    with SpecdecClient(stack.address("waiting"), retries=100, backoff_s=0.05) as client:
        t0 = time.monotonic()
        with pytest.raises(SpecdecClientError) as err:
            client.complete("x", timeout=0.5)
        assert time.monotonic() - t0 < 8.0      # 100 retries would take far longer
        assert err.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_timeouts_are_grpc_deadlines(stack):
    watch = SessionWatch(stack, *BACKENDS)
    with SpecdecClient(stack.address("orchestrator"), timeout=0.3) as client:
        with pytest.raises(SpecdecDeadlineExceeded):
            client.complete(PROMPT, max_new_tokens=400)
        assert client.complete(PROMPT, max_new_tokens=2, timeout=30).stats.completion_tokens == 2

    async def run_async():
        async with AsyncSpecdecClient(stack.address("orchestrator")) as client:
            with pytest.raises(SpecdecDeadlineExceeded):
                await client.complete(PROMPT, max_new_tokens=400, timeout=0.3)
            with pytest.raises(SpecdecDeadlineExceeded):
                async for _ in client.generate(PROMPT, max_new_tokens=400, timeout=0.3):
                    pass

    asyncio.run(run_async())
    assert watch.released() == {"verifier": 0, "drafter": 0}


def test_typed_errors_carry_code_and_details(stack):
    with SpecdecClient(stack.address("orchestrator")) as client:
        with pytest.raises(SpecdecInvalidArgument) as err:
            client.complete("x", temperature=-1.0)
        assert isinstance(err.value, SpecdecClientError)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.value.details
        with pytest.raises(SpecdecInvalidArgument):      # a stream fails on its first read
            next(client.generate(""))
        with pytest.raises(ValueError, match="method"):
            client.complete("x", method="beam")
        with pytest.raises(ValueError, match="proposals"):
            client.complete("x", proposals="greedy")
        # values are the server's to check (specdec.request.params bounds), the field named in the details
        for params, field in (({"request_id": "r" * 1_000_000}, "request_id"),
                              ({"value_temperature": float("nan")}, "tree.value_temperature"),
                              ({"seed": 2**64 - 1, "temperature": float("inf")}, "sampling.temperature")):
            with pytest.raises(SpecdecInvalidArgument) as err:
                client.complete("x", max_new_tokens=2, **params)
            assert err.value.details.startswith(field), err.value.details

    async def run_async():
        async with AsyncSpecdecClient(stack.address("orchestrator")) as client:
            with pytest.raises(SpecdecInvalidArgument) as err:
                await client.complete("x", top_p=2.0)
            assert "top_p" in err.value.details

    asyncio.run(run_async())


@dataclass(frozen=True)
class Tls:
    ca: str
    cert: str | None = None
    key: str | None = None


def test_tls_and_mutual_tls(stack, certs):
    pem = certs
    stack.add_orchestrator("mtls", drafter="drafter", tls_cert=pem["server.pem"], tls_key=pem["server.key"],
                           tls_client_ca=pem["ca.pem"])
    try:
        address = stack.address("mtls")
        mtls = Tls(pem["ca.pem"], pem["client.pem"], pem["client.key"])
        with SpecdecClient(address, tls=mtls) as client:
            assert client.complete("x", max_new_tokens=2).stats.completion_tokens == 2
        with SpecdecClient(address, tls=pem["ca.pem"], retries=0, timeout=5) as client:   # no client certificate
            with pytest.raises(SpecdecUnavailable):
                client.complete("x", max_new_tokens=2)
        with SpecdecClient(address, retries=0, timeout=5) as client:                       # plaintext
            with pytest.raises(SpecdecUnavailable):
                client.complete("x", max_new_tokens=2)
    finally:
        stack.stop("mtls")


def test_sdk_and_orchestrator_import_no_torch():
    code = ("import sys, specdec.client, specdec.cli.remote, orchestrator.service, orchestrator.loop, "
            "orchestrator.text; bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_build_request_carries_the_new_parameters():
    from specdec.client.sdk import build_request
    from specdec.request.wire import generation_request_from_proto

    msg = build_request([5, 6, 7], min_p=0.1, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                        logprobs=0, n=3, seed=9, temperature=1.0)
    req = generation_request_from_proto(msg)
    assert req.prompt == "" and req.prompt_ids == (5, 6, 7) and req.logprobs == 0 and req.n == 3
    s = req.sampling
    assert (s.min_p, s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == \
        pytest.approx((0.1, 0.5, -0.5, 1.2))
    chat = generation_request_from_proto(build_request(messages=[{"role": "user", "content": "hi"}, ("assistant", "")]))
    assert [(m.role, m.content) for m in chat.messages] == [("user", "hi"), ("assistant", "")]
    plain = generation_request_from_proto(build_request("x"))
    assert plain.logprobs is None and plain.n == 1 and not plain.sampling.penalized
    assert plain.sampling.logit_bias == () and plain.prompt_logprobs is None and not plain.prompt_only
    scored = generation_request_from_proto(build_request("x", logit_bias={9: -100.0, 2: 2.5}, prompt_logprobs=4,
                                                         prompt_only=True))
    assert scored.sampling.logit_bias == ((2, 2.5), (9, -100.0))
    assert scored.prompt_logprobs == 4 and scored.prompt_only and scored.max_new_tokens == 0


def test_sync_and_async_carry_logprobs_and_choices(stack):
    address = stack.address("orchestrator")
    kw = dict(max_new_tokens=12, logprobs=2, n=2, temperature=1.0, seed=3, repetition_penalty=1.2)
    with SpecdecClient(address) as client:
        whole = client.complete(PROMPT, **kw)

    async def run_async():
        async with AsyncSpecdecClient(address) as client:
            stream = client.generate(PROMPT, **kw)
            chunks = [chunk async for chunk in stream]
            return stream, chunks

    stream, chunks = asyncio.run(run_async())
    assert [c.index for c in whole.choices] == [0, 1]
    for i, choice in enumerate(whole.choices):
        assert stream.choices[i].token_ids == choice.token_ids
        assert [e.token for e in choice.logprobs] == choice.token_ids
        assert [e.logprob for e in stream.choices[i].logprobs] == pytest.approx([e.logprob for e in choice.logprobs])
        assert [t for c in chunks if c.index == i for t in c.token_ids] == choice.token_ids
    assert whole.logprobs == whole.choices[0].logprobs and stream.logprobs == stream.choices[0].logprobs
