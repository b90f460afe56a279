"""The base of the verifier and drafter servicers: one engine, one worker thread.

Engine calls (torch forwards) are not reentrant per model and would block the
event loop, so they run one at a time on a dedicated thread while the loop
keeps answering health checks; idle sessions are swept on the same thread.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from specdec import metrics
from specdec.errors import Unavailable
from specdec.server import Lifecycle

log = logging.getLogger("specdec.server")


class EngineServicer:
    """Base of the verifier and drafter servicers.

    Engine calls are CPU/GPU-bound and not reentrant per model, so they run one
    at a time on a dedicated worker thread (the event loop keeps answering
    health checks). A call cancelled before it starts is skipped; one that has
    started runs to completion, so a cancelled RPC never leaves a session half
    updated. Idle sessions are evicted by a periodic sweep on the same thread.
    Subclasses set ``role`` and ``self.sessions`` (a SessionTable) when loaded,
    and may override ``_kv_bytes``.
    """

    role = "engine"

    def __init__(self) -> None:
        self.lifecycle = Lifecycle()
        self.lifecycle.busy = lambda: self.stats.active > 0
        self.stats = metrics.SessionStats(self.role)
        self.sessions = None                # SessionTable, once loaded
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.role}-engine")
        self._sweeper: asyncio.Task | None = None
        self._closed = False

    @property
    def loaded(self) -> bool:
        return self.sessions is not None

    def check(self, opens_session: bool = False) -> None:
        if not self.loaded:
            raise Unavailable("server is loading its model")
        self.lifecycle.check(opens_session)

    async def run(self, fn: Callable, *args, shield: bool = False):
        """``fn(*args)`` on the worker thread -> (result, seconds it ran)."""
        ctx = contextvars.copy_context()       # keeps the request id in worker-thread logs
        future = asyncio.get_running_loop().run_in_executor(self._executor, ctx.run, self._timed, fn, args)
        return await (asyncio.shield(future) if shield else future)

    def _timed(self, fn: Callable, args: tuple):
        start = time.perf_counter()
        try:
            return fn(*args), time.perf_counter() - start
        finally:
            self._refresh_stats()

    def _refresh_stats(self) -> None:
        if self.sessions is not None:
            self.stats.update(len(self.sessions), self._kv_bytes())

    def _kv_bytes(self) -> int:
        return 0

    def start_sweeper(self, ttl_s: float | None = None) -> None:
        ttl = self.sessions.ttl_s if ttl_s is None else ttl_s
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep(min(max(ttl / 4, 0.02), 30.0)))

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
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.stats.close()


# -- the interceptor -------------------------------------------------------------------------
