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

    def __init__(self, solo_threads: int = 0) -> None:
        if solo_threads < 0:
            raise ValueError(f"solo threads must be >= 0, got {solo_threads}")
        self.solo_threads = solo_threads    # torch threads while at most one session is open (0: unchanged)
        self._shared_threads: int | None = None   # torch threads otherwise: the worker's setting at start
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

    async def run(self, fn: Callable, *args, shield: bool = False, opening: bool = False):
        """``fn(*args)`` on the worker thread -> (result, seconds it ran);
        ``opening``: the call opens a session (for the solo-threads count)."""
        ctx = contextvars.copy_context()       # keeps the request id in worker-thread logs
        future = asyncio.get_running_loop().run_in_executor(self._executor, ctx.run, self._timed, fn, args,
                                                            opening)
        return await (asyncio.shield(future) if shield else future)

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
