"""Serving ``orchestrator.http``'s app with uvicorn on the orchestrator's own event loop.

The HTTP API shares the process, the loop and the ``OrchestratorService``
with the gRPC server: the same readiness, the same drain (a draining service
refuses new sessions with UNAVAILABLE, i.e. 503, and ``RunningServer.stop``
waits for the open ones, HTTP ones included), and signals stay the gRPC
server's (``specdec.serving.server.install_signal_drain``); uvicorn installs none.
The socket is bound before ``start`` returns, so port 0 gives a known free
port and a taken port fails at once. TLS (and mutual TLS) uses the same
certificate files as the gRPC port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl

import uvicorn

from orchestrator.chat_template import MessageRenderer
from orchestrator.http import HttpConfig, build_app
from orchestrator.service import OrchestratorService

log = logging.getLogger("specdec.orchestrator")

SHUTDOWN_GRACE_S = 5.0     # after the drain, what uvicorn gives connections still open


class EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: the process's drain owns SIGTERM / SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot serve HTTP on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


class HttpServer:
    def __init__(self, service: OrchestratorService, config: HttpConfig):
        self.config = config
        self.sock = bind(config.host, config.port)
        self.port: int = self.sock.getsockname()[1]
        tls = {}
        if config.tls_cert:
            tls = {"ssl_certfile": config.tls_cert, "ssl_keyfile": config.tls_key}
            if config.tls_client_ca:
                tls.update(ssl_ca_certs=config.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        uv_config = uvicorn.Config(build_app(service, config), log_config=None, access_log=False,
                                   lifespan="off", timeout_graceful_shutdown=SHUTDOWN_GRACE_S, **tls)
        self.server = EmbeddedServer(uv_config)
        self.task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.config.tls_cert else "http"
        host = self.config.host if self.config.host not in ("0.0.0.0", "::") else "127.0.0.1"
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return f"{scheme}://{host}:{self.port}"

    async def start(self) -> None:
        """Serve until ``stop``; raises if uvicorn cannot start."""
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()
                raise OSError(f"the HTTP server on port {self.port} did not start")
            await asyncio.sleep(0.01)
        log.info("http listening", extra={"port": self.port, "tls": bool(self.config.tls_cert),
                                          "auth": self.config.auth_token is not None})

    async def stop(self) -> None:
        if self.task is not None and not self.task.done():
            self.server.should_exit = True
            await self.task
        self.sock.close()


async def start_http(service: OrchestratorService, config: HttpConfig) -> HttpServer:
    """Serve the API; a service with no chat renderer yet renders the ``messages``
    of gRPC requests with the API's chat template too."""
    if service.chat_renderer is None and config.chat_template is not None:
        service.chat_renderer = MessageRenderer(config.chat_template, service.tokenizer)
    server = HttpServer(service, config)
    try:
        await server.start()
    except BaseException:
        server.sock.close()
        raise
    return server
