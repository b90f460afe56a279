"""Client SDK for the specdec orchestrator (``specdec.v1.OrchestratorService``).

Needs only grpcio, the generated messages and specdec's torch-free parameter
layer (``specdec.request.params``, ``specdec.request.wire``)::

    with SpecdecClient("127.0.0.1:50051") as client:
        stream = client.generate("def fib(n):", max_new_tokens=64)
        for chunk in stream:            # leaving the loop early cancels the call
            print(chunk.text, end="")
        print(stream.stats.tau)

        result = client.complete("def fib(n):", max_new_tokens=64, timeout=10)

        # token ids or chat messages as the prompt; penalties, min_p, logit_bias, logprobs, n choices
        result = client.complete([1, 2, 3], max_new_tokens=16, logprobs=5, repetition_penalty=1.2,
                                 logit_bias={42: -100.0})

        # structured output: json_schema=, regex=, grammar= (Lark) or json_object=True
        result = client.complete("A point:", max_new_tokens=64, json_schema={"type": "object", "properties": {
            "x": {"type": "integer"}}, "required": ["x"]})

        # the prompt's log-likelihood alone (what an eval harness asks)
        scored = client.complete("The sky is blue", prompt_only=True, prompt_logprobs=0)
        print(sum(lp.logprob for lp in scored.prompt_logprobs))
        result = client.complete(messages=[{"role": "user", "content": "Hi"}], n=2, temperature=1.0, seed=7)
        for choice in result.choices:
            print(choice.text, [lp.logprob for lp in choice.logprobs])

``AsyncSpecdecClient`` is the same API for asyncio (``async with``,
``async for``, ``await client.complete(...)``).

Errors arrive as ``SpecdecClientError`` subclasses chosen by status code, each
with ``.code`` (a ``grpc.StatusCode``) and ``.details``. A call that fails
with UNAVAILABLE before the server sent anything is retried (``retries``
times, exponential backoff from ``backoff_s``, within the deadline); once a
stream has delivered a message it is never retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import grpc

from specdec.request.constraints import constraint_from
from specdec.request.params import PROPOSALS as PROPOSALS  # re-exported: the names build_request accepts
from specdec.client.results import Choice, Chunk, Completion, GenerationStats
from specdec.request.params import REQUEST_METHODS, ChatMessage, SamplingParams, TokenLogprob, is_request_id
from specdec.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from specdec.request.wire import METHOD_TO_PROTO, PROPOSALS_TO_PROTO, enum_to_proto, logprobs_from_proto, sampling_to_proto

METHODS = REQUEST_METHODS                # "vanilla" included: no drafting
Prompt = str | Sequence[int] | None      # text, token ids, or None with messages=[...]

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_MAX_BACKOFF_S = 2.0


# -- errors --------------------------------------------------------------------
class SpecdecClientError(Exception):
    """A failed call: ``code`` is the gRPC status code, ``details`` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}" if details else code.name)
        self.code = code
        self.details = details


class SpecdecInvalidArgument(SpecdecClientError): ...
class SpecdecNotFound(SpecdecClientError): ...
class SpecdecResourceExhausted(SpecdecClientError): ...
class SpecdecUnavailable(SpecdecClientError): ...
class SpecdecUnauthenticated(SpecdecClientError): ...
class SpecdecDeadlineExceeded(SpecdecClientError): ...
class SpecdecCancelled(SpecdecClientError): ...


_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: SpecdecInvalidArgument,
    grpc.StatusCode.NOT_FOUND: SpecdecNotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: SpecdecResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: SpecdecUnavailable,
    grpc.StatusCode.UNAUTHENTICATED: SpecdecUnauthenticated,
    grpc.StatusCode.DEADLINE_EXCEEDED: SpecdecDeadlineExceeded,
    grpc.StatusCode.CANCELLED: SpecdecCancelled,
}


def error_from(exc: grpc.RpcError) -> SpecdecClientError:
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    code = code or grpc.StatusCode.UNKNOWN
    return _ERRORS.get(code, SpecdecClientError)(code, details or "")


def chat_messages(messages: Iterable) -> list[orchestrator_pb2.ChatMessage]:
    """Messages as ``{"role": ..., "content": ...}`` dicts, (role, content) pairs or ``ChatMessage``."""
    out = []
    for m in messages:
        if isinstance(m, dict):
            role, content = m.get("role", ""), m.get("content", "")
        elif isinstance(m, ChatMessage):
            role, content = m.role, m.content
        else:
            role, content = m
        out.append(orchestrator_pb2.ChatMessage(role=role, content=content))
    return out


# -- requests ------------------------------------------------------------------
def build_request(prompt: Prompt = None, *, messages: Iterable | None = None,
                  max_new_tokens: int = 0, temperature: float = 0.0, top_p: float = 1.0,
                  top_k: int = 0, seed: int | None = None, stop: Iterable[str] = (), method: str | None = None,
                  total_tokens: int = 0, depth: int = 0, expand_k: int = 0, value_temperature: float = 0.0,
                  proposals: str = "auto", request_id: str = "", min_p: float = 0.0, presence_penalty: float = 0.0,
                  frequency_penalty: float = 0.0, repetition_penalty: float = 1.0, logprobs: int | None = None,
                  n: int = 1, logit_bias: Mapping[int, float] | None = None, prompt_logprobs: int | None = None,
                  prompt_only: bool = False, json_schema: Mapping | str | None = None, regex: str | None = None,
                  grammar: str | None = None, json_object: bool = False,
                  cache_salt: str = "") -> orchestrator_pb2.GenerateRequest:
    """The request message; 0 / None leave a knob to the server's default.
    ``prompt``: text, or token ids (a sequence of ints); or ``messages``
    instead (a chat, rendered with the model's chat template by the server).
    ``logprobs``: each token's raw-model logprob with that many top
    alternatives (0..20; None: none). ``n``: independent choices, seeded from
    ``seed``. Penalties, min_p and ``logit_bias`` ({token id: bias in [-100,
    100]}) follow ``specdec.request.params.SamplingParams``. ``prompt_logprobs``:
    the prompt's tokens' logprobs (all but the first) with that many
    alternatives, in ``Completion.prompt_logprobs`` (``complete`` only);
    ``prompt_only``: generate nothing (``max_new_tokens`` 0), the prompt alone.
    Structured output, at most one of: ``json_schema`` (a JSON Schema, as a
    mapping or its text), ``regex``, ``grammar`` (Lark, llguidance's dialect),
    ``json_object`` (any JSON object): the output follows it exactly, under
    speculation too (``specdec.request.constraints``).
    ``cache_salt``: cached prompt prefixes are shared only between requests of
    the same tenant (bearer token) and the same salt.
    ``method``: one of ``METHODS`` ("vanilla": no drafting); ``proposals``: how
    draft tokens are proposed when sampling ("auto": the drafter's choice;
    "top" / "sampled"). Names are checked here (ValueError); values are checked
    by the server against ``specdec.request.params``'s bounds, INVALID_ARGUMENT naming
    the offending field."""
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, min_p=min_p,
                              presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                              repetition_penalty=repetition_penalty, logit_bias=logit_bias or (),
                              constraint=constraint_from(json_schema, regex, grammar, json_object))
    tree = common_pb2.TreeParams(
        method=common_pb2.TREE_METHOD_UNSPECIFIED if method is None else enum_to_proto(method, METHOD_TO_PROTO, "method"),
        total_tokens=total_tokens, depth=depth, expand_k=expand_k, value_temperature=value_temperature,
        proposals=enum_to_proto(proposals, PROPOSALS_TO_PROTO, "proposals"))
    if isinstance(stop, str):
        stop = [stop]
    text, ids = (prompt, []) if prompt is None or isinstance(prompt, str) else ("", list(prompt))
    msg = orchestrator_pb2.GenerateRequest(prompt=text or "", prompt_ids=ids, max_new_tokens=max_new_tokens,
                                           sampling=sampling_to_proto(sampling), stop=list(stop), tree=tree,
                                           request_id=request_id, messages=chat_messages(messages or ()), n=n,
                                           prompt_only=prompt_only, cache_salt=cache_salt)
    if logprobs is not None:
        msg.logprobs = logprobs
    if prompt_logprobs is not None:
        msg.prompt_logprobs = prompt_logprobs
    return msg


def channel_credentials(tls: Any) -> grpc.ChannelCredentials | None:
    """``tls``: None/False (plaintext), True (system roots), a CA bundle path,
    an object with ``ca``/``cert``/``key`` PEM paths (mutual TLS when cert and
    key are set; an optional ``server_name`` overrides the name expected in the
    server's certificate; e.g. ``specdec.serving.server.ClientTls``) or ready credentials."""
    if tls is None or tls is False:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    if isinstance(tls, grpc.ChannelCredentials):
        return tls
    if isinstance(tls, str):
        return grpc.ssl_channel_credentials(root_certificates=_read(tls))
    ca, cert, key = (getattr(tls, name, None) for name in ("ca", "cert", "key"))
    return grpc.ssl_channel_credentials(root_certificates=_read(ca), private_key=_read(key),
                                        certificate_chain=_read(cert))


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


class _Deadline:
    def __init__(self, timeout: float | None):
        self.at = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())


def _retry_delay(attempt: int, backoff_s: float, deadline: _Deadline) -> float | None:
    """Seconds to wait before retry ``attempt`` (1-based), None when there is no time left."""
    delay = min(backoff_s * 2 ** (attempt - 1), _MAX_BACKOFF_S)
    left = deadline.remaining()
    if left is not None and left <= delay:
        return None
    return delay


class _ClientBase:
    def __init__(self, target: str, token: str | None, tls: Any, timeout: float | None, retries: int,
                 backoff_s: float):
        self.target = target
        self.timeout = timeout
        self.retries = max(0, retries)
        self.backoff_s = backoff_s
        self._token = token
        self._credentials = channel_credentials(tls)
        self._channel_options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        server_name = getattr(tls, "server_name", None)
        if server_name:
            self._channel_options.append(("grpc.ssl_target_name_override", server_name))

    def _metadata(self, request: orchestrator_pb2.GenerateRequest) -> list[tuple[str, str]]:
        md = []
        if self._token:
            md.append(("authorization", f"Bearer {self._token}"))
        if is_request_id(request.request_id):    # one the server would refuse is left to its answer
            md.append(("x-request-id", request.request_id))
        return md

    def _deadline(self, timeout: float | None) -> _Deadline:
        return _Deadline(self.timeout if timeout is None else timeout)

    def _retryable(self, exc: grpc.RpcError, attempt: int, deadline: _Deadline) -> float | None:
        if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt > self.retries:
            return None
        return _retry_delay(attempt, self.backoff_s, deadline)


# -- streams -------------------------------------------------------------------
class _Stream:
    """What the sync and async streams share: the call, retries, the results."""

    def __init__(self, start: Callable[[float | None], Any], deadline: _Deadline,
                 retryable: Callable[[grpc.RpcError, int, _Deadline], float | None]):
        self._start = start
        self._deadline = deadline
        self._retryable = retryable
        self._call = None
        self._attempt = 0
        self._received = False
        self._closed = False
        self.choices: dict[int, Choice] = {0: Choice()}   # by index; n > 1 streams fill in more

    @property
    def stats(self) -> GenerationStats | None:
        """Choice 0's stats, once the stream is over."""
        return self.choices[0].stats

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return self.choices[0].logprobs

    def _open(self):
        if self._call is None:
            self._attempt += 1
            self._call = self._start(self._deadline.remaining())
        return self._call

    def _retry_delay(self, exc: grpc.RpcError) -> float:
        """Seconds to wait before calling again; raises the typed error when not retrying."""
        delay = None if self._received else self._retryable(exc, self._attempt, self._deadline)
        if delay is None:
            self._closed = True
            raise error_from(exc) from None
        self._call = None
        return delay

    def _accept(self, msg: orchestrator_pb2.GenerateResponse) -> Chunk | None:
        self._received = True
        if msg.HasField("final"):
            self.choices.setdefault(msg.final.index, Choice(msg.final.index)).stats = \
                GenerationStats.from_proto(msg.final)
            return None
        chunk = Chunk(list(msg.chunk.token_ids), msg.chunk.text, logprobs_from_proto(msg.chunk.logprobs),
                      msg.chunk.index)
        choice = self.choices.setdefault(chunk.index, Choice(chunk.index))
        choice.token_ids.extend(chunk.token_ids)
        choice.text += chunk.text
        choice.logprobs.extend(chunk.logprobs)
        return chunk

    def _ended(self) -> None:
        self._closed = True
        if any(c.stats is None for c in self.choices.values()):
            raise SpecdecClientError(grpc.StatusCode.INTERNAL, "stream ended without final stats")

    def close(self) -> None:
        """Cancel the call (no effect once the stream is over)."""
        if not self._closed:
            self._closed = True
            if self._call is not None:
                self._call.cancel()

    def __del__(self) -> None:
        if getattr(self, "_call", None) is not None:
            with contextlib.suppress(RuntimeError):      # the event loop may be gone already
                self.close()


class GenerationStream(_Stream):
    """Iterator of ``Chunk``; ``stats`` is set once it is exhausted. ``close()``
    (or leaving a ``with`` block / dropping the iterator) cancels the call."""

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> Chunk:
        while not self._closed:
            try:
                msg = next(self._open())
            except StopIteration:
                self._ended()
                break
            except grpc.RpcError as exc:
                time.sleep(self._retry_delay(exc))
                continue
            chunk = self._accept(msg)
            if chunk is not None:
                return chunk
        raise StopIteration

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SpecdecClient(_ClientBase):
    """Blocking client; ``timeout`` is the default deadline (seconds) of each call."""

    def __init__(self, target: str, token: str | None = None, tls: Any = None, timeout: float | None = None,
                 retries: int = 3, backoff_s: float = 0.1):
        super().__init__(target, token, tls, timeout, retries, backoff_s)
        if self._credentials is None:
            self._channel = grpc.insecure_channel(target, options=self._channel_options)
        else:
            self._channel = grpc.secure_channel(target, self._credentials, options=self._channel_options)
        self._stub = orchestrator_pb2_grpc.OrchestratorServiceStub(self._channel)

    def generate(self, prompt: Prompt = None, *, timeout: float | None = None, **params) -> GenerationStream:
        request = build_request(prompt, **params)
        metadata = self._metadata(request)

        def start(remaining: float | None):
            return self._stub.Generate(request, timeout=remaining, metadata=metadata)

        return GenerationStream(start, self._deadline(timeout), self._retryable)

    def complete(self, prompt: Prompt = None, *, timeout: float | None = None, **params) -> Completion:
        request = orchestrator_pb2.CompleteRequest(request=build_request(prompt, **params))
        metadata = self._metadata(request.request)
        deadline = self._deadline(timeout)
        attempt = 0
        while True:
            attempt += 1
            try:
                resp = self._stub.Complete(request, timeout=deadline.remaining(), metadata=metadata)
            except grpc.RpcError as exc:
                delay = self._retryable(exc, attempt, deadline)
                if delay is None:
                    raise error_from(exc) from None
                time.sleep(delay)
                continue
            return Completion.from_proto(resp)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> SpecdecClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- asyncio -------------------------------------------------------------------
class AsyncGenerationStream(_Stream):
    """Async iterator of ``Chunk``; ``stats`` is set once it is exhausted.
    ``await aclose()`` (or leaving an ``async with`` block) cancels the call."""

    def __aiter__(self) -> AsyncGenerationStream:
        return self

    async def __anext__(self) -> Chunk:
        while not self._closed:
            try:
                msg = await self._open().read()
            except grpc.RpcError as exc:
                await asyncio.sleep(self._retry_delay(exc))
                continue
            except asyncio.CancelledError:
                self.close()
                raise
            if msg is grpc.aio.EOF:
                self._ended()
                break
            chunk = self._accept(msg)
            if chunk is not None:
                return chunk
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class AsyncSpecdecClient(_ClientBase):
    """asyncio client; ``timeout`` is the default deadline (seconds) of each call."""

    def __init__(self, target: str, token: str | None = None, tls: Any = None, timeout: float | None = None,
                 retries: int = 3, backoff_s: float = 0.1):
        super().__init__(target, token, tls, timeout, retries, backoff_s)
        if self._credentials is None:
            self._channel = grpc.aio.insecure_channel(target, options=self._channel_options)
        else:
            self._channel = grpc.aio.secure_channel(target, self._credentials, options=self._channel_options)
        self._stub = orchestrator_pb2_grpc.OrchestratorServiceStub(self._channel)

    def generate(self, prompt: Prompt = None, *, timeout: float | None = None, **params) -> AsyncGenerationStream:
        request = build_request(prompt, **params)
        metadata = self._metadata(request)

        def start(remaining: float | None):
            return self._stub.Generate(request, timeout=remaining, metadata=metadata)

        return AsyncGenerationStream(start, self._deadline(timeout), self._retryable)

    async def complete(self, prompt: Prompt = None, *, timeout: float | None = None, **params) -> Completion:
        request = orchestrator_pb2.CompleteRequest(request=build_request(prompt, **params))
        metadata = self._metadata(request.request)
        deadline = self._deadline(timeout)
        attempt = 0
        while True:
            attempt += 1
            try:
                resp = await self._stub.Complete(request, timeout=deadline.remaining(), metadata=metadata)
            except grpc.RpcError as exc:
                delay = self._retryable(exc, attempt, deadline)
                if delay is None:
                    raise error_from(exc) from None
                await asyncio.sleep(delay)
                continue
            return Completion.from_proto(resp)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncSpecdecClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
