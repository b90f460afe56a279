"""Collecting concurrent engine calls into batches, shared by the verifier and
drafter services (``verifier.batch.BatchScheduler``, ``drafter.batch.DraftScheduler``).

A batch closes when it holds ``max_batch`` calls, when every session that
could still join (``expected()``: sessions open on the engine) has joined,
or ``window_s`` after its first call, so a lone session never waits.
``runner(items)`` runs the batched engine call where the model lives and
returns (one result or exception per item, seconds). Cancelled calls are
skipped; an unexpected failure of the runner fails every call of the batch.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable


class BatchScheduler:
    def __init__(self, runner: Callable[[list], Awaitable[tuple[list, float]]], expected: Callable[[], int],
                 window_s: float = 0.003, max_batch: int = 16):
        self.runner, self.expected = runner, expected
        self.window_s, self.max_batch = window_s, max_batch
        self._pending: list[tuple[object, asyncio.Future]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.batches = 0                 # batches run
        self.batched_items = 0           # calls in them
        self.multi_batches = 0           # batches of more than one call

    async def submit(self, item) -> tuple[object, float]:
        """(this item's result, seconds of the batched call it was part of)."""
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((item, fut))
        self._wake.set()
        return await fut

    def _full(self) -> bool:
        return len(self._pending) >= min(self.max_batch, max(1, self.expected()))

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            deadline = time.monotonic() + self.window_s
            while not self._full() and time.monotonic() < deadline:
                await asyncio.sleep(min(0.0005, max(0.0, deadline - time.monotonic())))
            batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
            if not self._pending:
                self._wake.clear()
            live = [(item, fut) for item, fut in batch if not fut.cancelled()]
            if not live:
                continue
            self.batches += 1
            self.batched_items += len(live)
            self.multi_batches += len(live) > 1
            try:
                results, seconds = await self.runner([item for item, _ in live])
            except Exception as exc:  # noqa: BLE001 - an unexpected failure fails the whole batch
                results, seconds = [exc] * len(live), 0.0
            for (_, fut), res in zip(live, results):
                if fut.cancelled():
                    continue
                if isinstance(res, Exception):
                    fut.set_exception(res)
                else:
                    fut.set_result((res, seconds))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
