"""What every specdec gRPC server shares (DESIGN.md §7), for the verifier,
drafter and orchestrator alike.

- ``start_server``: a grpc.aio server with the role's services, grpc.health.v1
  ("liveness" SERVING at once; "readiness", "" and each hosted service
  NOT_SERVING until ``set_ready(True)``), server reflection, optional TLS /
  mutual TLS, an optional bearer token, and Prometheus on its own HTTP port.
- One interceptor per server (``specdec.serving.interceptor``): request ids, the token
  check (health checks are exempt so probes work), RPC metrics, the in-flight
  count that autoscaling reads, and errors: servicers' handlers just raise and
  the interceptor answers with the status the error stands for
  (``status_code_of``; unexpected errors: INTERNAL, logged once).
- Drain: readiness goes NOT_SERVING, servicers refuse new sessions, open
  sessions and in-flight RPCs get up to ``drain_s`` to finish, then the server
  stops. SIGTERM / SIGINT start it (``install_signal_drain``); a second signal
  stops at once.
- ``open_channel`` for calls between services (TLS, token and the request id
  passed on).
- ``Lifecycle``: loading -> ready -> draining, which servicers check; the
  verifier and drafter servicers' shared base lives in ``specdec.serving.engine_servicer``.

No torch here: the orchestrator imports this module.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.request.errors import Unavailable
from specdec.serving import metrics
from specdec.serving.interceptor import HEALTH_SERVICE, RpcInterceptor, abort_from, status_code_of
from specdec.serving.logs import configure_logging, request_id_var

__all__ = ["ServerConfig", "ClientTls", "Lifecycle", "RunningServer", "start_server", "run_server",
           "install_signal_drain", "open_channel", "abort_from", "status_code_of", "configure_logging",
           "request_id_var"]

log = logging.getLogger("specdec.serving.server")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0                      # 0 = pick a free port
    metrics_port: int | None = 0       # Prometheus HTTP port; 0 = free port; None = disabled
    tls_cert: str | None = None        # server cert/key (PEM paths) -> TLS
    tls_key: str | None = None
    tls_client_ca: str | None = None   # set -> mutual TLS (client certificates required)
    auth_token: str | None = None      # bearer token required on every RPC but health checks
    drain_s: float = 20.0              # drain: time given to open sessions and in-flight RPCs
    max_message_mb: int = 64

    def __post_init__(self):
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name.replace('_', '-')} must be in [0, 65535], got {value}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate and a key (--tls-cert and --tls-key)")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("mutual TLS (--tls-client-ca) needs the server's --tls-cert and --tls-key")
        if self.auth_token is not None and not self.auth_token.strip():
            raise ValueError("auth token must not be empty")
        if self.drain_s < 0:
            raise ValueError(f"drain time must be >= 0, got {self.drain_s}")

    def grpc_options(self) -> list[tuple[str, int]]:
        size = self.max_message_mb * 1024 * 1024
        # no SO_REUSEPORT: a second server on a taken port must fail, not share it
        return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size),
                ("grpc.so_reuseport", 0)]


@dataclass(frozen=True)
class ClientTls:                       # for channels between services
    ca: str | None = None              # CA that signed the server's certificate (None: system roots)
    cert: str | None = None            # client certificate + key, for mutual TLS
    key: str | None = None
    server_name: str | None = None     # expected name in the server's certificate, if not the host


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what} file not found: {p}")
    return p.read_bytes()


# -- readiness ---------------------------------------------------------------------------
class Lifecycle:
    """loading -> ready -> draining, as a servicer sees it.

    ``RunningServer.set_ready`` and ``stop`` drive it for every servicer that
    has a ``lifecycle`` attribute; servicers call ``check`` first thing."""

    def __init__(self) -> None:
        self.ready = False
        self.draining = False
        self.busy: Callable[[], bool] = lambda: False   # drain waits while True (open sessions)

    def check(self, opens_session: bool = False) -> None:
        if self.draining:
            if opens_session:
                raise Unavailable("server is draining: it takes no new sessions")
        elif not self.ready:
            raise Unavailable("server is loading its model")


class _Health(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 with a synchronous ``set`` (readiness flips from any code)."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {}
        self._changed = asyncio.Event()
        self._final = False

    def set(self, service: str, status: int) -> None:
        if self._final:
            return
        self._status[service] = status
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def shutdown(self) -> None:
        for service in self._status:
            self.set(service, NOT_SERVING)
        self._final = True

    async def Check(self, request, context):
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, context):
        last = None
        while True:
            changed = self._changed
            status = self._status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            await changed.wait()

    async def List(self, request, context):
        return health_pb2.HealthListResponse(
            statuses={s: health_pb2.HealthCheckResponse(status=v) for s, v in self._status.items()})


# -- the server ------------------------------------------------------------------------------
class RunningServer:
    def __init__(self, server: grpc.aio.Server, health: _Health, port: int, metrics_http,
                 services: list[tuple[Callable, object, str]], name: str, in_flight: list[int]):
        self.name = name
        self.port = port
        self.metrics_port = None if metrics_http is None else int(metrics_http.server_port)
        self._server = server
        self._health = health
        self._metrics_http = metrics_http
        self._servicers = [s for _, s, _ in services]
        self._service_names = [n for _, _, n in services]
        self._lifecycles = [s.lifecycle for s in self._servicers if isinstance(getattr(s, "lifecycle", None), Lifecycle)]
        self._in_flight = in_flight
        self._stopping = False
        self._hurry = asyncio.Event()
        self._stopped = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.ready = False

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def in_flight(self) -> int:
        """RPCs being served now (health checks and reflection aside)."""
        return self._in_flight[0]

    def set_ready(self, ready: bool) -> None:
        """Health "readiness" (and "" and each hosted service) SERVING / NOT_SERVING."""
        self.ready = ready and not self._stopping
        for lc in self._lifecycles:
            lc.ready = self.ready
        status = SERVING if self.ready else NOT_SERVING
        for service in ["readiness", "", *self._service_names]:
            self._health.set(service, status)

    def listening_record(self) -> dict:
        return {"event": "listening", "port": self.port, "metrics_port": self.metrics_port}

    def _idle(self) -> bool:
        return self.in_flight == 0 and not any(lc.busy() for lc in self._lifecycles)

    async def stop(self, grace: float | None = None) -> None:
        """Drain for up to ``grace`` seconds (None: stop now), then stop."""
        if self._stopping:
            if grace is None:
                self._hurry.set()
            await self._stopped.wait()
            return
        self._stopping = True
        self.set_ready(False)
        for lc in self._lifecycles:
            lc.draining = True
        remaining = None
        if grace:
            log.info("draining", extra={"server": self.name, "grace_s": grace})
            deadline = time.monotonic() + grace
            while not self._idle() and not self._hurry.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            remaining = None if self._hurry.is_set() else max(0.0, deadline - time.monotonic())
        self._health.shutdown()
        await self._server.stop(remaining)
        for servicer in self._servicers:
            close = getattr(servicer, "aclose", None)
            if close is not None:
                await close()
        if self._metrics_http is not None:
            # shutdown() blocks for up to the server's poll interval: not on the loop
            http = self._metrics_http
            threading.Thread(target=lambda: (http.shutdown(), http.server_close()), daemon=True).start()
        log.info("stopped", extra={"server": self.name})
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _server_credentials(cfg: ServerConfig):
    if cfg.tls_cert is None:
        return None
    key, cert = _read(cfg.tls_key, "TLS key"), _read(cfg.tls_cert, "TLS certificate")
    ca = _read(cfg.tls_client_ca, "TLS client CA")
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


async def start_server(cfg: ServerConfig, services: list[tuple[Callable, object, str]], name: str) -> RunningServer:
    """services: (add_XServicer_to_server, servicer, "specdec.v1.XService") triples."""
    in_flight = [0]
    server = grpc.aio.server(interceptors=[RpcInterceptor(name, cfg.auth_token, in_flight)],
                             options=cfg.grpc_options())
    health = _Health()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for add, servicer, _ in services:
        add(servicer, server)
    reflection.enable_server_reflection([n for _, _, n in services] + [HEALTH_SERVICE, reflection.SERVICE_NAME],
                                        server)
    creds = _server_credentials(cfg)
    address = _address(cfg.host, cfg.port)
    try:
        port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {address}: {exc}") from None
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    metrics_http = None
    if cfg.metrics_port is not None:
        try:
            metrics_http = metrics.start_metrics_server(cfg.metrics_port, cfg.host)
        except OSError as exc:
            await server.stop(None)
            raise OSError(f"cannot serve metrics on {_address(cfg.host, cfg.metrics_port)}: {exc}") from None
    running = RunningServer(server, health, port, metrics_http, services, name, in_flight)
    health.set("liveness", SERVING)
    running.set_ready(False)
    log.info("listening", extra={"server": name, "port": port, "metrics_port": running.metrics_port,
                                 "tls": creds is not None, "mtls": cfg.tls_client_ca is not None,
                                 "auth": cfg.auth_token is not None})
    return running


def install_signal_drain(server: RunningServer, drain_s: float) -> None:
    """SIGTERM/SIGINT -> drain for up to ``drain_s``; a second signal stops at once."""
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        grace = None if server.stopping else drain_s
        log.info("signal", extra={"signal": sig.name, "action": "stop now" if grace is None else "drain"})
        task = loop.create_task(server.stop(grace))
        server._tasks.add(task)
        task.add_done_callback(server._tasks.discard)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)


async def run_server(cfg: ServerConfig, services: list[tuple[Callable, object, str]], name: str,
                     load: Callable[[], Awaitable[None]] | None = None, ready_file: str | None = None) -> None:
    """Start, print the listening line on stdout, load and warm up (``load``),
    go ready (and write ``ready_file``), serve until drained."""
    server = await start_server(cfg, services, name)
    record = server.listening_record()
    print(json.dumps(record), flush=True)
    install_signal_drain(server, cfg.drain_s)
    try:
        if load is not None:
            await load()
    except BaseException as exc:
        if server.stopping and isinstance(exc, Exception):
            await server.wait()                 # a signal stopped the server while it loaded
            return
        if isinstance(exc, Exception):
            log.error("loading failed", exc_info=exc)
        await server.stop(None)
        raise
    if not server.stopping:
        server.set_ready(True)
        log.info("ready", extra={"server": name})
        if ready_file:
            tmp = Path(f"{ready_file}.tmp")
            tmp.write_text(json.dumps(record) + "\n")
            tmp.replace(ready_file)
    await server.wait()


# -- channels between services -------------------------------------------------------------
class _OutgoingMetadata:
    """Adds the bearer token and the current request id to a call's metadata.
    One subclass per call kind: grpc.aio files an interceptor under the first
    kind it implements only, so one class implementing all four would reach
    unary calls alone (streams would go out without the token)."""

    def __init__(self, token: str | None):
        self._auth = None if token is None else f"Bearer {token}"

    def _details(self, details):
        md = grpc.aio.Metadata(*tuple(details.metadata or ()))
        if self._auth is not None and "authorization" not in md:
            md.add("authorization", self._auth)
        rid = request_id_var.get()
        if rid and "x-request-id" not in md:
            md.add("x-request-id", rid)
        return details._replace(metadata=md)


class _UnaryUnaryMetadata(_OutgoingMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _UnaryStreamMetadata(_OutgoingMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamUnaryMetadata(_OutgoingMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _StreamStreamMetadata(_OutgoingMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def outgoing_metadata(token: str | None) -> list[_OutgoingMetadata]:
    """The interceptors that put the token (when there is one) on every kind of
    call, and the request id on unary calls at least. Without a token, streams
    go out uninterceptored: an intercepted stream passes each message through
    a queue and a task of grpc's own, on the per-cycle path."""
    kinds = (_UnaryUnaryMetadata, _UnaryStreamMetadata, _StreamUnaryMetadata, _StreamStreamMetadata)
    return [kind(token) for kind in (kinds if token is not None else kinds[:1])]


def open_channel(target: str, tls: ClientTls | None = None, token: str | None = None,
                 max_message_mb: int = 64) -> grpc.aio.Channel:
    size = max_message_mb * 1024 * 1024
    options = [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size)]
    interceptors = outgoing_metadata(token)
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    if (tls.cert is None) != (tls.key is None):
        raise ValueError("a client certificate needs its key (and the other way round)")
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    creds = grpc.ssl_channel_credentials(root_certificates=_read(tls.ca, "TLS CA"),
                                         private_key=_read(tls.key, "TLS client key"),
                                         certificate_chain=_read(tls.cert, "TLS client certificate"))
    return grpc.aio.secure_channel(target, creds, options=options, interceptors=interceptors)
