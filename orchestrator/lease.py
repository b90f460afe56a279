"""Leases on the backends' sessions: how a backend learns that the
orchestrator holding a session is gone (killed, OOM, partitioned) within
seconds rather than after its idle TTL.

Every session this orchestrator opens carries its ``owner`` id (one random id
per process) in the Prefill. From the moment a Prefill is sent until the
session's Release has been answered (or has failed), the session is *held*
on that endpoint; every ``RENEW_EVERY_S`` one Renew per backend lists the
sessions held there, and the backend renews their lease. A backend evicts a
session whose lease has not been renewed for its ``--lease-s`` (default 4 s,
``specdec.serving.sessions``), so a dead orchestrator's sessions go a few seconds
after its last renewal. A Renew that fails is only logged: the next one
follows a second later, and a lease outlives several missed renewals.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Hashable, Protocol

from specdec.v1 import drafter_pb2, verifier_pb2

log = logging.getLogger("specdec.orchestrator")

RENEW_EVERY_S = 1.0
RENEW_REQUESTS = {"verifier": verifier_pb2.VerifierRenewRequest, "drafter": drafter_pb2.DrafterRenewRequest}


class Endpoint(Hashable, Protocol):
    """What a lease needs of ``orchestrator.routing.Endpoint``."""

    role: str                               # "verifier" | "drafter"
    address: str
    stub: object                            # the role's service stub (has Renew)


class Leases:
    """The sessions this orchestrator holds on each endpoint, renewed in the background."""

    def __init__(self, every_s: float = RENEW_EVERY_S):
        if not every_s > 0:
            raise ValueError(f"lease renewal interval must be > 0 seconds, got {every_s}")
        self.owner = uuid.uuid4().hex       # sent with every Prefill; the backends know this process by it
        self.every_s = every_s
        self.held: dict[Endpoint, set[str]] = {}
        self._task: asyncio.Task | None = None

    def hold(self, endpoint: Endpoint, sid: str) -> None:
        """``sid`` may be open on ``endpoint`` (a Prefill was sent there)."""
        self.held.setdefault(endpoint, set()).add(sid)

    def drop(self, endpoint: Endpoint, sid: str) -> None:
        """``sid`` is no longer held on ``endpoint`` (released, or given up)."""
        sids = self.held.get(endpoint)
        if sids is not None:
            sids.discard(sid)
            if not sids:
                del self.held[endpoint]

    def holding(self, endpoint: Endpoint) -> frozenset[str]:
        return frozenset(self.held.get(endpoint, ()))

    async def renew(self) -> None:
        """One Renew per endpoint holding sessions, all at once."""
        await asyncio.gather(*(self._renew(e, sorted(sids)) for e, sids in list(self.held.items()) if sids))

    async def _renew(self, endpoint: Endpoint, sids: list[str]) -> None:
        request = RENEW_REQUESTS[endpoint.role](owner=self.owner, session_ids=sids)
        try:
            await endpoint.stub.Renew(request, timeout=self.every_s)
        except Exception as exc:           # a lost backend: its sessions are gone or will lapse
            log.debug("lease renewal failed", extra={"backend": endpoint.address, "error": str(exc)})

    def start(self) -> None:
        """Renew every ``every_s`` until ``aclose``."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.renew()
            except Exception:
                log.exception("renewing session leases failed")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
