"""The base of the verifier and drafter servicers: one engine, one worker thread.

Engine calls (torch forwards) are not reentrant per model and would block the
event loop, so they run one at a time on a dedicated thread while the loop
keeps answering health checks; idle sessions are swept on the same thread.

Solo threads (``--solo-threads``): where the drafter and the verifier share a
host's cores, each gets a share of them, because once requests overlap both
compute at once and oversubscribed OpenMP threads stall each other. With at
most one session open the two services alternate (draft, verify, draft, ...),
so an engine call may then use all the cores; the servicer switches torch's
thread count on its worker thread before each call.

Opening a session (``open_session``) leaves nothing behind however the RPC
ends: the engine call cannot be stopped once it started, so when the RPC is
cancelled or its deadline passes while it runs, the session it opens is
released as soon as it lands. A session opened with an owner is put under
that owner's lease (``specdec.serving.sessions``), renewed by ``renew`` (the Renew
RPC); the sweep evicts lapsed leases as well as idle sessions, at least every
quarter of a lease.

Session streams (``serve_session``, the Session RPC of both services): one
session's per-cycle steps on one long-lived bidirectional stream, each step
handled exactly as its unary RPC (same checks, same engine call, same
statuses) and answered in order. The first step opens the session; the
session is released when the stream ends, however it ends: the client
half-closing it (its release), cancelling it, or the connection breaking (a
lost orchestrator frees its sessions at once rather than when its lease
lapses). An error ends the stream with the error's status.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import AsyncIterator, Awaitable, Callable

from specdec.request.errors import InvalidArgument, Unavailable
from specdec.request.params import MAX_LEASED_SESSIONS, check_owner, check_session_id, shown
from specdec.serving import metrics
from specdec.serving.server import Lifecycle
from specdec.serving.sessions import DEFAULT_LEASE_S

log = logging.getLogger("specdec.serving.server")

IDLE_POLL_S = 0.05                      # how often ``start_when_idle`` looks for an idle moment


class EngineServicer:
    """Base of the verifier and drafter servicers.

    Engine calls are CPU/GPU-bound and not reentrant per model, so they run one
    at a time on a dedicated worker thread (the event loop keeps answering
    health checks). A call cancelled before it starts is skipped; one that has
    started runs to completion, so a cancelled RPC never leaves a session half
    updated. Idle sessions are evicted by a periodic sweep on the same thread.
    Subclasses set ``role`` and ``self.sessions`` (a SessionTable) when loaded,
    implement ``release_session`` and may override ``_kv_bytes``.
    """

    role = "engine"

    def __init__(self, solo_threads: int = 0, lease_s: float = DEFAULT_LEASE_S) -> None:
        if solo_threads < 0:
            raise ValueError(f"solo threads must be >= 0, got {solo_threads}")
        if not lease_s > 0:
            raise ValueError(f"lease must be > 0 seconds, got {lease_s}")
        self.solo_threads = solo_threads    # torch threads while at most one session is open (0: unchanged)
        self.lease_s = lease_s              # an owned session outlives its owner's last renewal by this much
        self._shared_threads: int | None = None   # torch threads otherwise: the worker's setting at start
        self.lifecycle = Lifecycle()
        self.lifecycle.busy = lambda: self.stats.active > 0
        self.stats = metrics.SessionStats(self.role)
        self.prefix_stats = metrics.PrefixStats(self.role)
        self.sessions = None                # SessionTable, once loaded
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.role}-engine")
        self._jobs: set[Future] = set()     # queued or running on it
        self._idle_work: asyncio.Task | None = None
        self._sweeper: asyncio.Task | None = None
        self._closed = False

    @property
    def loaded(self) -> bool:
        return self.sessions is not None

    def check(self, opens_session: bool = False) -> None:
        if not self.loaded:
            raise Unavailable("server is loading its model")
        self.lifecycle.check(opens_session)

    async def run(self, fn: Callable, *args, shield: bool = False, opening: bool = False):
        """``fn(*args)`` on the worker thread -> (result, seconds it ran);
        ``opening``: the call opens a session (for the solo-threads count)."""
        ctx = contextvars.copy_context()       # keeps the request id in worker-thread logs
        future = asyncio.wrap_future(self._submit(ctx.run, self._timed, fn, args, opening))
        return await (asyncio.shield(future) if shield else future)

    def _submit(self, fn: Callable, *args) -> Future:
        """``fn(*args)`` queued on the worker thread, counted until it ends (``idle``)."""
        job = self._executor.submit(fn, *args)
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)
        return job

    @property
    def idle(self) -> bool:
        """No engine call queued or running and no session open."""
        return not self._jobs and self.sessions is not None and len(self.sessions) == 0

    def start_when_idle(self, fn: Callable[[], bool], every_s: float = IDLE_POLL_S) -> None:
        """Call ``fn()`` on the worker thread whenever the servicer is ``idle``,
        until it returns False (nothing left to do): work that would stall a
        request's step if it ran beside one (opening compiled graphs holds the
        GIL). A request that comes meanwhile waits for that one call."""
        self._idle_work = asyncio.create_task(self._when_idle(fn, every_s))

    async def _when_idle(self, fn: Callable[[], bool], every_s: float) -> None:
        while not self._closed:
            await asyncio.sleep(every_s)
            if not self.idle:
                continue
            try:
                more, _ = await self.run(fn)
            except Exception as exc:   # noqa: BLE001 - the work is an optimisation: what is left happens on first use
                log.warning("work left for idle moments failed; left to first use",
                            extra={"role": self.role, "error": f"{type(exc).__name__}: {exc}"})
                return
            if not more:
                return

    def release_session(self, sid: str) -> bool:
        """On the worker thread: free session ``sid``; whether it was open."""
        raise NotImplementedError

    async def open_session(self, context, sid: str, owner: str, fn: Callable, *args):
        """``fn(*args)``, which opens session ``sid``, on the worker thread ->
        (result, seconds it ran); the session goes under ``owner``'s lease ("":
        none). An RPC that ends while the call is queued skips it; one that ends
        while it runs gets the session released when it lands, and so does one
        cancelled after the call landed but before its answer went out."""
        ctx = contextvars.copy_context()
        job = self._submit(ctx.run, self._timed, self._open, (sid, owner, fn, args), True)
        try:
            result = await asyncio.shield(asyncio.wrap_future(job))
        except asyncio.CancelledError:
            if not job.cancel():
                job.add_done_callback(lambda done: self._release_landed(sid, done))
            raise
        if rpc_ended(context):
            await self.run(self.release_session, sid, shield=True)
            raise TimeoutError(f"the request ended while session {shown(sid)} was opening; it was released")
        if context is not None:
            # a cancel the handler did not see before it returned (the client has no answer): release then
            context.add_done_callback(lambda ended: ended.cancelled() and self._release_landed(sid, job))
        return result

    def _open(self, sid: str, owner: str, fn: Callable, args: tuple):
        result = self._evict_then(fn, *args)
        self.sessions.lease(sid, owner)
        return result

    def _release_landed(self, sid: str, job: Future) -> None:
        """``job`` opened ``sid`` for an RPC that has ended: release it on the worker thread."""
        if job.cancelled() or job.exception() is not None:
            return
        try:
            self._executor.submit(self._timed, self._release_ended, (sid,))     # (stats refreshed after it)
        except RuntimeError:                    # shut down: the sessions go with the process
            return

    def _release_ended(self, sid: str) -> None:
        if self.release_session(sid):
            log.info("released a session opened after its request ended", extra={"role": self.role, "session": sid})

    async def serve_session(self, requests: AsyncIterator, context, steps: dict[str, Callable[..., Awaitable]],
                            response_type) -> AsyncIterator:
        """The Session RPC: each message's ``step`` (a oneof: "prefill" first,
        then any other of ``steps``) answered by ``steps[step](message, context)``
        in a ``response_type`` with the same oneof; releases the session when the
        stream ends."""
        sid: str | None = None
        try:
            async for message in requests:
                step = message.WhichOneof("step")
                if step is None or step not in steps:
                    raise InvalidArgument(f"a session stream message needs one of {', '.join(steps)}, got {step}")
                request = getattr(message, step)
                if (step == "prefill") != (sid is None):
                    raise InvalidArgument(f"a session stream opens with one prefill and has no other, got "
                                          f"{step} {'first' if sid is None else 'later'}")
                if step == "prefill":
                    opening = check_session_id(request.session_id)
                    answer = await steps[step](request, context)
                    sid = opening
                else:
                    if not request.session_id:
                        request.session_id = sid
                    elif request.session_id != sid:
                        raise InvalidArgument(f"session_id {shown(request.session_id)} on the stream of "
                                              f"session {shown(sid)}")
                    answer = await steps[step](request, context)
                yield response_type(**{step: answer})
        finally:
            if sid is not None and self.loaded:
                try:
                    await self.run(self.release_session, sid, shield=True)
                except RuntimeError:            # shut down: the sessions go with the process
                    pass

    def renew(self, owner: str, session_ids) -> int:
        """The Renew RPC: renew ``owner``'s lease on ``session_ids`` -> how many it holds here.
        Runs on the event loop, never queued behind an engine call."""
        self.check()
        owner = check_owner(owner)
        if not owner:
            raise InvalidArgument("owner must not be empty")
        if len(session_ids) > MAX_LEASED_SESSIONS:
            raise InvalidArgument(f"session_ids: at most {MAX_LEASED_SESSIONS} per call, got {len(session_ids)}")
        ids = [check_session_id(sid, f"session_ids[{i}]") for i, sid in enumerate(session_ids)]
        return self.sessions.renew(owner, ids)

    def _timed(self, fn: Callable, args: tuple, opening: bool = False):
        if self.solo_threads:
            self._pick_threads(opening)
        start = time.perf_counter()
        try:
            return fn(*args), time.perf_counter() - start
        finally:
            self._refresh_stats()

    def _pick_threads(self, opening: bool) -> None:
        """On the worker thread: ``solo_threads`` while at most one session is
        open (counting one the call opens), the shared count otherwise."""
        import torch

        if self._shared_threads is None:
            self._shared_threads = torch.get_num_threads()
        open_sessions = (len(self.sessions) if self.sessions is not None else 0) + int(opening)
        want = self.solo_threads if open_sessions <= 1 else self._shared_threads
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

    def _refresh_stats(self) -> None:
        if self.sessions is not None:
            self.stats.update(len(self.sessions), self._kv_bytes())
            cache = self._prefix_cache()
            if cache is not None:
                self.prefix_stats.update(cache.stats, cache.tokens)

    def _kv_bytes(self) -> int:
        return 0

    def _prefix_cache(self):
        """The engine's ``specdec.model.prefix_cache.PrefixCache`` (None: none)."""
        return None

    def start_sweeper(self, ttl_s: float | None = None) -> None:
        self.sessions.lease_s = self.lease_s
        ttl = self.sessions.ttl_s if ttl_s is None else ttl_s
        every_s = min(max(min(ttl, self.lease_s) / 4, 0.02), 30.0)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep(every_s))

    def _evict(self) -> list[str]:
        return self.sessions.evict_idle()

    def _evict_idle(self) -> list[str]:
        evicted = self._evict()
        if evicted:
            metrics.SESSIONS_EVICTED.labels(self.role).inc(len(evicted))
            log.info("evicted idle sessions", extra={"role": self.role, "sessions": evicted})
        return evicted

    def _evict_then(self, fn: Callable, *args):
        """Evict (and count) idle sessions, then ``fn(*args)``: a new session
        never fails on the cap because of a session that is already stale."""
        self._evict_idle()
        return fn(*args)

    async def _sweep(self, every_s: float) -> None:
        while not self._closed:
            await asyncio.sleep(every_s)
            try:
                await self.run(self._evict_idle)
            except Exception:
                if self._closed:                # the executor was shut down under us
                    return
                log.exception("idle-session sweep failed", extra={"role": self.role})

    async def aclose(self) -> None:
        self._closed = True
        for task in (self._sweeper, self._idle_work):
            if task is not None:
                task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.stats.close()
        self.prefix_stats.close()



def rpc_ended(context) -> bool:
    """Whether the RPC behind ``context`` was cancelled or ran past its deadline."""
    if context is None:
        return False
    if context.cancelled():
        return True
    left = context.time_remaining()
    return left is not None and left <= 0
