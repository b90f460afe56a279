"""One role's side of a session on the backends: the endpoint it is pinned
to, its calls under the request's deadline, and its release.

Transport time: each call's wall time minus the compute its response reports
(all of it for a call that failed) adds to the handle's ``network_s``, which
the speculative loop books as network; the rest is the backend's compute.
A session is held on an endpoint from the moment a Prefill is sent there,
whatever becomes of that call: a backend runs its engine calls in order and
cannot stop one that started, so a Prefill still in flight when the request
ends (client deadline, cancel) lands before the Release that follows it. A
held session is under this orchestrator's lease (``orchestrator.lease``)
until it is released, once, on the endpoint that holds it and on every
endpoint it was moved away from (a lost backend may still hold it).

Session streams (``streams``, the default): the per-cycle steps (Prefill,
Verify; Prefill, Draft, DraftAhead) travel on one long-lived bidirectional
stream per session and endpoint (the role's Session RPC, under the request's
deadline), opened by the Prefill; a message and its answer cost about half a
unary call here. A broken stream is a failed call: its status becomes the
``BackendError`` the failover path already handles, and the next Prefill (on
the endpoint pinned in its place) opens a new stream. Release half-closes
the stream, and the backend releases the session as the stream ends; a
stream cut mid-step (the request cancelled) is cancelled, which releases the
session there too once the step in flight lands, and a unary Release
follows. Other calls stay unary.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod

import grpc

from specdec.request.errors import SpecdecError
from orchestrator.lease import Leases
from orchestrator.routing import PROBE_TIMEOUT_S, Endpoint, Pool

log = logging.getLogger("specdec.orchestrator")

RELEASE_TIMEOUT_S = 5.0


class DeadlineExceeded(SpecdecError):
    code = "DEADLINE_EXCEEDED"


class Deadline:
    def __init__(self, timeout: float | None):
        self.at = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        if self.at is None:
            return None
        left = self.at - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("deadline exceeded")
        return left

    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at


class BackendError(SpecdecError):
    """A verifier or drafter call failed; keeps its status code."""

    def __init__(self, backend: str, method: str, status: grpc.StatusCode, details: str = "", address: str = ""):
        self.status = status
        self.code = self.status.name
        where = f"{backend} {address}" if address else backend
        super().__init__(f"{where} {method}: {details or self.code}")


class Backend(ABC):
    """One role's side of a session: the endpoint it is pinned to, the ones it
    gave up (released at the end too), and its calls under the request's deadline."""

    role: str                                   # "verifier" | "drafter"
    stream_steps: dict[str, str]                # call name -> its step in the role's Session messages
    session_request: type                       # the role's Session request message

    def __init__(self, pool: Pool, session_id: str, deadline: Deadline, leases: Leases, streams: bool = True):
        self.pool = pool
        self.session_id = session_id
        self.deadline = deadline
        self.leases = leases
        self.endpoint: Endpoint | None = None
        self.sent_prefill = False               # to the pinned endpoint: it may hold the session
        self.moves = 0
        self.excluded: set[str] = set()
        self.abandoned: list[Endpoint] = []     # may still hold the session
        self.network_s = 0.0
        self.released = False
        self.streams = streams                  # per-cycle steps on a session stream (else unary calls)
        self.stream: grpc.aio.StreamStreamCall | None = None   # open on the pinned endpoint
        self.stepping = False                   # a step's answer is awaited on ``stream``
        self.wire_bytes = 0                     # serialized bytes of the calls' requests and answers

    def probe_timeout(self) -> float:
        """How long a probe made on behalf of this request may take."""
        left = self.deadline.remaining()
        return PROBE_TIMEOUT_S if left is None else min(PROBE_TIMEOUT_S, left)

    async def call(self, name: str, request, account: bool = True):
        """One call to the pinned endpoint; ``account``: its transport time goes
        to ``network_s`` (a call that runs beside another is accounted by the caller)."""
        if name == "Prefill":
            self.sent_prefill = True
            self.leases.hold(self.endpoint, self.session_id)
        start = time.perf_counter()
        try:
            if self.streams and name in self.stream_steps:
                response = await self.step(name, request)
            else:
                response = await getattr(self.endpoint.stub, name)(request, timeout=self.deadline.remaining())
        except (grpc.aio.AioRpcError, BackendError) as exc:
            if account:
                self.network_s += time.perf_counter() - start
            raise self.failure(name, exc) from None
        if account:
            wall = time.perf_counter() - start
            self.network_s += wall - min(getattr(response, "compute_s", wall), wall)
        self.wire_bytes += request.ByteSize() + response.ByteSize()
        return response

    def failure(self, name: str, exc: grpc.aio.AioRpcError | BackendError) -> BackendError:
        """What a failed call is to the session. Past the request's deadline it is
        DEADLINE_EXCEEDED whatever the transport said: a session stream's call
        ends at that deadline, and a step racing its end may see INTERNAL
        ("Internal error from Core") or a call already finished instead. A
        backend's CANCELLED is UNAVAILABLE: a stopping server cancels its calls."""
        if self.deadline.passed():
            return BackendError(self.role, name, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded",
                                self.endpoint.address)
        if isinstance(exc, BackendError):
            return exc
        if exc.code() == grpc.StatusCode.CANCELLED:
            # A call this process cancels raises asyncio.CancelledError, not a status: CANCELLED
            # came from the backend, which cancels its calls when it stops. It is gone.
            return BackendError(self.role, name, grpc.StatusCode.UNAVAILABLE,
                                f"the backend cancelled the call (stopping): {exc.details()}", self.endpoint.address)
        return BackendError(self.role, name, exc.code(), exc.details(), self.endpoint.address)

    async def step(self, name: str, request):
        """One step on the session stream (a Prefill opens a new one); the stream
        ending without an answer is UNAVAILABLE."""
        if name == "Prefill" or self.stream is None:
            self.close_stream()
            self.stream = self.endpoint.stub.Session(timeout=self.deadline.remaining())
        field, stream = self.stream_steps[name], self.stream
        self.stepping = True
        try:
            await stream.write(self.session_request(**{field: request}))
        except asyncio.InvalidStateError:
            # the call ended between steps (its deadline, or the backend's end): that status is this step's
            code = await stream.code()
            details = await stream.details()
            self.close_stream()
            raise BackendError(self.role, name, grpc.StatusCode.UNAVAILABLE if code == grpc.StatusCode.OK else code,
                               details or "the session stream had ended", self.endpoint.address) from None
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.INTERNAL:
                raise
            # grpc's own INTERNAL ("Internal error from Core"): the core could not send the
            # step, the connection went (a stopping backend)
            self.close_stream()
            raise BackendError(self.role, name, grpc.StatusCode.UNAVAILABLE,
                               f"the session stream broke: {exc.debug_error_string()}", self.endpoint.address) from None
        answer = await stream.read()
        self.stepping = False
        if answer == grpc.aio.EOF or answer.WhichOneof("step") != field:
            self.close_stream()
            raise BackendError(self.role, name, grpc.StatusCode.UNAVAILABLE, "the session stream ended unanswered",
                               self.endpoint.address)
        return getattr(answer, field)

    def close_stream(self) -> None:
        """Drop the session stream, cancelling it if still open (the backend then releases the session)."""
        stream, self.stream, self.stepping = self.stream, None, False
        if stream is not None and not stream.done():
            stream.cancel()

    def unpin(self, exc: BackendError) -> None:
        """Stop using the pinned endpoint for this session after ``exc``."""
        endpoint, self.endpoint = self.endpoint, None
        self.sent_prefill = False
        self.close_stream()
        self.pool.unpin(endpoint)
        if exc.status == grpc.StatusCode.UNAVAILABLE:
            self.pool.failed(endpoint, str(exc))
        if exc.status != grpc.StatusCode.NOT_FOUND:
            # a restarted server (NOT_FOUND) may take the session again; others are done for this request
            self.excluded.add(endpoint.address)
        if exc.status not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED):
            self.abandoned.append(endpoint)
        else:                                   # it holds nothing (refused, or forgot the session)
            self.leases.drop(endpoint, self.session_id)

    @abstractmethod
    def release_request(self):
        """The role's Release message for this session."""

    async def release(self) -> None:
        """Unpin, and release the session everywhere it may be held (once)."""
        if self.released:
            return
        self.released = True
        current = []
        if self.endpoint is not None:
            self.pool.unpin(self.endpoint)
            if self.sent_prefill:
                current.append(self.endpoint)

        async def release(endpoint: Endpoint) -> None:
            try:
                if endpoint in current and await self.end_stream():
                    return
                await endpoint.stub.Release(self.release_request(), timeout=RELEASE_TIMEOUT_S)
            except Exception as exc:      # a lost backend's failure is expected, the others' worth a line
                if endpoint in current:   # (its lease lapses there in seconds)
                    log.warning("release failed", extra={"session": self.session_id, "backend": endpoint.address,
                                                         "error": str(exc)})
            finally:
                self.leases.drop(endpoint, self.session_id)

        await asyncio.gather(*(release(e) for e in current + self.abandoned))
        self.close_stream()

    async def end_stream(self) -> bool:
        """Release by half-closing an idle session stream and waiting for its end;
        False when there is none (or it is mid-step: it is cancelled) and a
        Release call must do it."""
        stream = self.stream
        if stream is None or stream.done() or self.stepping:
            self.close_stream()
            return False
        try:
            ended = await asyncio.wait_for(self.finish(stream), RELEASE_TIMEOUT_S)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError):
            ended = False                       # (the call ended meanwhile: a Release call makes sure)
        self.close_stream()
        return ended

    @staticmethod
    async def finish(stream: grpc.aio.StreamStreamCall) -> bool:
        """Half-close ``stream`` and wait for its end; whether it ended OK."""
        await stream.done_writing()
        return await stream.code() == grpc.StatusCode.OK
