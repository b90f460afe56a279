"""Where sessions go: pools of verifier and drafter endpoints, discovery and least-loaded picks.

Each role has a ``Pool`` of ``Endpoint``s, found from a static list of
HOST:PORT and / or the DNS name of a Kubernetes headless Service, which
answers with one address per *ready* pod. The name is resolved again every
``resolve_interval_s`` (``socket.getaddrinfo`` on a thread, the event loop
never blocks); an address that disappears is *drained*: it gets no new
sessions, the ones pinned to it go on until they end or fail, then its channel
is closed. Every ``probe_interval_s`` each endpoint is probed: healthy means
its grpc.health.v1 "readiness" is SERVING (not while loading or draining) and
GetInfo answers; GetInfo's ``max_sessions`` is the capacity. A probe that is
refused (UNAVAILABLE, not ready) marks an endpoint unhealthy at once, and so
does a call that fails with UNAVAILABLE (``Pool.failed``); a probe that only
times out does so after ``SLOW_PROBES`` in a row (a server busy with a long
prefill on a loaded host is slow, not gone). The next good probe brings it
back. When a request finds no usable endpoint, ``Pool.acquire`` probes the
unhealthy ones once more before answering UNAVAILABLE.

Every backend must use the first verifier's vocabulary; one that does not is
logged and gets no sessions. Load = sessions / capacity, where sessions counts what this orchestrator has
pinned there plus what other clients held at the last probe (several
orchestrators share the backends). A request is pinned to the least loaded
verifier and drafter (ties broken at random); a full verifier pool sheds load
with RESOURCE_EXHAUSTED, an unreachable one is UNAVAILABLE. Drafters are
optional: ``Pool.pick`` with ``optional`` returns None and a reason, and the
request runs as plain decoding on its verifier.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import socket
import time
from dataclasses import dataclass, replace
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.request.errors import ResourceExhausted, Unavailable
from specdec.request.pace import Paces
from specdec.serving.server import ClientTls, open_channel
from specdec.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from orchestrator.lease import Leases

log = logging.getLogger("specdec.orchestrator")

PROBE_TIMEOUT_S = 2.0
SLOW_PROBES = 3                # probes in a row that time out before an endpoint counts as lost
REPROBE_AFTER_S = 0.5          # a request probes an unhealthy endpoint again at most this often
Resolver = Callable[[str, int], Awaitable[list[str]]]
Fits = Callable[[str, object], "str | None"]      # (role, GetInfo answer) -> why it cannot serve, or None


@dataclass(frozen=True)
class Discovery:
    """How one role's endpoints are found: a static list, a DNS name, or both."""

    static: tuple[str, ...] = ()           # HOST:PORT
    dns: str | None = None                 # HOST:PORT of a headless Service

    def __post_init__(self):
        for address in self.static + ((self.dns,) if self.dns else ()):
            split_address(address)

    @property
    def configured(self) -> bool:
        return bool(self.static or self.dns)

    def describe(self) -> str:
        parts = list(self.static) + ([f"dns:{self.dns}"] if self.dns else [])
        return ", ".join(parts) or "none"


def split_address(address: str) -> tuple[str, int]:
    """'host:port' / '[v6]:port' -> (host, port); ValueError naming the address otherwise."""
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host, int(port)


def parse_addresses(values) -> tuple[str, ...]:
    """Repeated and / or comma-separated HOST:PORT values, in order, without duplicates."""
    if isinstance(values, str):
        values = [values]
    out: list[str] = []
    for value in values or ():
        for part in value.split(","):
            part = part.strip()
            if part:
                split_address(part)
                if part not in out:
                    out.append(part)
    return tuple(out)


async def resolve_dns(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to, as HOST:PORT targets (IPv6 bracketed)."""
    infos = await asyncio.to_thread(socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM)
    out = []
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        address = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        if address not in out:
            out.append(address)
    return out


class Endpoint:
    """One verifier or drafter server as this orchestrator sees it."""

    def __init__(self, role: str, address: str, channel: grpc.aio.Channel, stub, via_dns: bool):
        self.role = role
        self.address = address
        self.channel = channel
        self.stub = stub
        self.health = health_pb2_grpc.HealthStub(channel)
        self.via_dns = via_dns
        self.info = None                   # the last GetInfo answer
        self.healthy = False
        self.draining = False              # gone from discovery: no new sessions
        self.problem: str | None = None    # set when it cannot serve this orchestrator (vocabulary)
        self.pinned = 0                    # sessions this orchestrator has pinned here
        self._others = 0                   # sessions other clients held at the last probe
        self._last_error: str | None = None
        self.slow_probes = 0               # probes in a row that timed out
        self.probed_at = -math.inf         # time.monotonic() of the last probe's start

    @property
    def capacity(self) -> float:
        cap = self.info.max_sessions if self.info is not None else 0
        return cap if cap > 0 else math.inf

    @property
    def sessions(self) -> int:
        return self.pinned + self._others

    @property
    def load(self) -> float:
        return self.sessions / self.capacity

    @property
    def usable(self) -> bool:
        return self.healthy and not self.draining and self.problem is None

    @property
    def full(self) -> bool:
        return self.sessions >= self.capacity

    def probed(self, info, pinned_when_asked: int | None = None) -> None:
        """A GetInfo answer. Its ``active_sessions`` includes ours, counted as of
        some moment while the probe was in flight: subtract the larger count."""
        self.info = info
        ours = self.pinned if pinned_when_asked is None else max(self.pinned, pinned_when_asked)
        self._others = max(0, info.active_sessions - ours)
        if not self.healthy:
            log.info("backend up", extra={"role": self.role, "address": self.address,
                                          "max_sessions": info.max_sessions})
        self.healthy = True
        self._last_error = None
        self.slow_probes = 0

    def lost(self, error: str) -> None:
        if self.healthy or self._last_error is None:
            # not up yet (never answered a probe): still starting, not a problem
            log.log(logging.WARNING if self.info is not None else logging.INFO, "backend unreachable",
                    extra={"role": self.role, "address": self.address, "error": error})
        self.healthy = False
        self._last_error = error

    def __repr__(self) -> str:
        return f"Endpoint({self.role} {self.address}, pinned={self.pinned}, healthy={self.healthy})"


class Pool:
    """The endpoints of one role."""

    def __init__(self, role: str, discovery: Discovery, tls: ClientTls | None = None, token: str | None = None,
                 resolver: Resolver = resolve_dns, fits: Fits | None = None):
        if role not in ("verifier", "drafter"):
            raise ValueError(f"role must be verifier or drafter, got {role!r}")
        self.role = role
        self.discovery = discovery
        self.endpoints: dict[str, Endpoint] = {}
        self._tls = tls
        self._token = token
        self._resolver = resolver
        self._fits = fits
        self._ties = random.Random()     # its own generator: the process's global one is left to others
        for address in discovery.static:
            self._add(address, via_dns=False)

    # -- discovery -----------------------------------------------------------------------------
    def _add(self, address: str, via_dns: bool) -> Endpoint:
        tls = self._tls
        if via_dns and tls is not None and not tls.server_name:
            # a certificate names the Service, not the pod address the name resolved to
            tls = replace(tls, server_name=split_address(self.discovery.dns)[0])
        channel = open_channel(address, tls, self._token)
        if self.role == "verifier":
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        else:
            stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        endpoint = Endpoint(self.role, address, channel, stub, via_dns)
        self.endpoints[address] = endpoint
        return endpoint

    async def resolve(self) -> None:
        """Look the DNS name up again: add new addresses, drain vanished ones."""
        if not self.discovery.dns:
            return
        host, port = split_address(self.discovery.dns)
        try:
            found = set(await self._resolver(host, port))
        except OSError as exc:
            # a headless Service with no ready pod has no address at all: everything drains
            log.warning("resolving failed", extra={"role": self.role, "name": self.discovery.dns,
                                                   "error": str(exc)})
            found = set()
        for address in sorted(found - set(self.endpoints)):
            log.info("backend discovered", extra={"role": self.role, "address": address})
            self._add(address, via_dns=True)
        for address, endpoint in self.endpoints.items():
            if not endpoint.via_dns:
                continue
            gone = address not in found
            if gone and not endpoint.draining:
                log.info("backend left discovery, draining", extra={"role": self.role, "address": address,
                                                                   "sessions": endpoint.pinned})
            endpoint.draining = gone
        await self.collect()

    async def collect(self) -> None:
        """Close drained endpoints that no session uses any more."""
        for address in [a for a, e in self.endpoints.items() if e.draining and e.pinned == 0]:
            endpoint = self.endpoints.pop(address)
            await endpoint.channel.close()

    # -- health ------------------------------------------------------------------------------------
    async def probe(self, timeout_s: float = PROBE_TIMEOUT_S) -> None:
        await asyncio.gather(*(self._probe(e, timeout_s) for e in list(self.endpoints.values())))

    async def _probe(self, endpoint: Endpoint, timeout_s: float) -> None:
        request = (verifier_pb2.VerifierGetInfoRequest() if self.role == "verifier"
                   else drafter_pb2.DrafterGetInfoRequest())
        readiness = health_pb2.HealthCheckRequest(service="readiness")
        pinned = endpoint.pinned
        endpoint.probed_at = time.monotonic()
        try:
            info, ready = await asyncio.gather(endpoint.stub.GetInfo(request, timeout=timeout_s),
                                               endpoint.health.Check(readiness, timeout=timeout_s))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                endpoint.slow_probes += 1
                if endpoint.slow_probes < SLOW_PROBES:
                    return
            endpoint.lost(exc.details() or exc.code().name)
            return
        if ready.status != health_pb2.HealthCheckResponse.SERVING:
            endpoint.lost("not ready (loading or draining)")
        else:
            problem = self._fits(self.role, info) if self._fits is not None else None
            if problem is not None and problem != endpoint.problem:
                log.error("backend does not fit, not used", extra={"role": self.role, "address": endpoint.address,
                                                                   "problem": problem})
            endpoint.problem = problem
            endpoint.probed(info, pinned)

    def failed(self, endpoint: Endpoint, error: str) -> None:
        """A call to ``endpoint`` could not reach it: no new sessions until a probe succeeds."""
        endpoint.lost(error)

    # -- picking ---------------------------------------------------------------------------------
    def pick(self, exclude: frozenset[str] = frozenset(), accept: Callable[[Endpoint], bool] | None = None,
             optional: bool = False) -> tuple[Endpoint | None, str]:
        """Pin a session to the least loaded usable endpoint (not in ``exclude``,
        passing ``accept``). Returns (endpoint, "") with ``pinned`` counted; with
        nothing to give, (None, reason) if ``optional``, else raises
        ResourceExhausted (all full) or Unavailable (none reachable)."""
        candidates = [e for e in self.endpoints.values()
                      if e.address not in exclude and e.usable and (accept is None or accept(e))]
        free = [e for e in candidates if not e.full]
        if free:
            lowest = min(e.load for e in free)
            endpoint = self._ties.choice([e for e in free if e.load == lowest])
            endpoint.pinned += 1
            return endpoint, ""
        known = len([e for e in self.endpoints.values() if not e.draining])
        if candidates:
            reason, message = "full", f"all {len(candidates)} {self.role}s are at capacity"
        else:
            reason = "unavailable"
            message = f"no {self.role} is reachable ({known} known: {self.discovery.describe()})"
        if optional:
            return None, reason
        raise (ResourceExhausted if candidates else Unavailable)(message)

    async def acquire(self, exclude: frozenset[str] = frozenset(), accept: Callable[[Endpoint], bool] | None = None,
                      optional: bool = False, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[Endpoint | None, str]:
        """``pick``, but when no endpoint is usable, probe the unhealthy ones now
        (they may have come back since the last round) and pick again."""
        endpoint, reason = self.pick(exclude, accept, optional=True)
        if endpoint is None and reason == "unavailable":
            recent = time.monotonic() - REPROBE_AFTER_S
            stale = [e for e in self.endpoints.values() if e.address not in exclude and not e.draining
                     and not e.healthy and e.probed_at < recent]
            if stale:
                await asyncio.gather(*(self._probe(e, timeout_s) for e in stale))
            endpoint, reason = self.pick(exclude, accept, optional=True)
        if endpoint is None and not optional:
            self.pick(exclude, accept)            # raises with the reason
        return endpoint, reason

    def unpin(self, endpoint: Endpoint) -> None:
        endpoint.pinned = max(0, endpoint.pinned - 1)

    def usable(self) -> list[Endpoint]:
        return [e for e in self.endpoints.values() if e.usable]

    async def aclose(self) -> None:
        for endpoint in self.endpoints.values():
            await endpoint.channel.close()
        self.endpoints.clear()


class Router:
    """The verifier pool, the drafter pool (may be empty) and the loop that keeps them current."""

    def __init__(self, verifiers: Discovery, drafters: Discovery, tls: ClientTls | None = None,
                 token: str | None = None, resolve_interval_s: float = 10.0, probe_interval_s: float = 2.0,
                 resolver: Resolver = resolve_dns):
        if not verifiers.configured:
            raise ValueError("no verifier configured: give a static address or a DNS name")
        for name, value in (("resolve interval", resolve_interval_s), ("probe interval", probe_interval_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        self.verifiers = Pool("verifier", verifiers, tls, token, resolver, self._fits)
        self.drafters = Pool("drafter", drafters, tls, token, resolver, self._fits)
        self.resolve_interval_s = resolve_interval_s
        self.probe_interval_s = probe_interval_s
        self.vocab_size: int | None = None   # the first verifier's; every backend must agree
        self.leases = Leases()               # the sessions this orchestrator holds, renewed on every backend
        self.paces = Paces()                 # what cycles cost per verifier–drafter pair (greedy gates)
        self._task: asyncio.Task | None = None

    @property
    def pools(self) -> tuple[Pool, Pool]:
        return self.verifiers, self.drafters

    async def refresh(self, resolve: bool = True) -> None:
        """One round: resolve the names (if ``resolve``), then probe every endpoint,
        verifiers first (their vocabulary is the one drafters must have)."""
        if resolve:
            await asyncio.gather(*(p.resolve() for p in self.pools))
        timeout = min(PROBE_TIMEOUT_S, self.probe_interval_s * 2)
        await self.verifiers.probe(timeout)
        await self.drafters.probe(timeout)

    def _fits(self, role: str, info) -> str | None:
        """Tokens must mean the same everywhere: a backend whose vocabulary differs
        from the first verifier's gets no sessions."""
        if self.vocab_size is None and role == "verifier":
            self.vocab_size = info.vocab_size
        if self.vocab_size is not None and info.vocab_size != self.vocab_size:
            return f"vocabulary of {info.vocab_size} tokens, the verifiers' is {self.vocab_size}"
        return None

    def start(self) -> None:
        """Keep resolving and probing in the background until ``aclose``."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        self.leases.start()

    async def _run(self) -> None:
        next_resolve = 0.0
        while True:
            now = time.monotonic()
            resolve = now >= next_resolve
            if resolve:
                next_resolve = now + self.resolve_interval_s
            try:
                await self.refresh(resolve)
            except Exception:
                log.exception("refreshing the backends failed")
            await asyncio.sleep(min(self.probe_interval_s, max(0.0, next_resolve - time.monotonic())))

    async def aclose(self) -> None:
        await self.leases.aclose()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        for pool in self.pools:
            await pool.aclose()
