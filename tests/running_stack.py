"""The three services in-process on 127.0.0.1 (port 0), on an event loop of their own.

The servers run on a daemon thread's loop so that a test may block on the
synchronous SDK, the CLI or a subprocess while they keep answering.

    stack = Stack(tiny_family)
    stack.add_verifier("verifier")
    stack.add_drafter("drafter-eagle", kind="eagle")
    stack.add_orchestrator("eagle", verifier="verifier", drafter="drafter-eagle")
    with SpecdecClient(stack.address("eagle")) as client: ...
    stack.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields

from serving.helpers import start_drafter, start_verifier


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="stack-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


async def start_orchestrator(verifier: str, drafter: str | None, tokenizer_dir, connect: bool = True, **cfg):
    """(RunningServer, OrchestratorService) calling the given backends; ``cfg``
    splits into ServerConfig fields and OrchestratorConfig fields."""
    from orchestrator.service import OrchestratorConfig, OrchestratorService
    from orchestrator.text import TextTokenizer
    from specdec.serving.server import ServerConfig, start_server

    server_fields = {f.name for f in fields(ServerConfig)}
    server_cfg = ServerConfig(**{"metrics_port": None, **{k: v for k, v in cfg.items() if k in server_fields}})
    config = OrchestratorConfig(verifier=verifier, drafter=drafter,
                                **{k: v for k, v in cfg.items() if k not in server_fields})
    servicer = OrchestratorService(config, TextTokenizer.load(tokenizer_dir))
    server = await start_server(server_cfg, [servicer.registration()], "orchestrator")
    if connect:
        await asyncio.wait_for(servicer.connect(retry_s=0.05), 30)
        server.set_ready(True)
    return server, servicer


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Stack:
    def __init__(self, paths) -> None:
        self.paths = paths
        self.loop = LoopThread()
        self.servers: dict[str, tuple[object, object]] = {}

    def add_verifier(self, name: str = "verifier", **cfg):
        self.servers[name] = self.loop.run(start_verifier(self.paths, metrics_port=None, **cfg))
        return self.servers[name]

    def plain_output(self, prompt: str, max_new_tokens: int) -> list[int]:
        """Greedy output of ``prompt`` on a fresh verifier, plain decoding: the
        reference a disturbed run (failover, routing) must reproduce."""
        from specdec.client import SpecdecClient

        self.add_verifier("ref-verifier")
        self.add_orchestrator("ref", verifier="ref-verifier")
        try:
            with SpecdecClient(self.address("ref"), timeout=60) as client:
                return client.complete(prompt, max_new_tokens=max_new_tokens).token_ids
        finally:
            self.stop("ref")
            self.stop("ref-verifier")

    def add_drafter(self, name: str, kind: str, **cfg):
        self.servers[name] = self.loop.run(start_drafter(self.paths, kind, metrics_port=None, **cfg))
        return self.servers[name]

    def add_orchestrator(self, name: str, verifier: str = "verifier", drafter: str | None = None,
                         connect: bool = True, **cfg):
        """``verifier`` / ``drafter``: names of servers in this stack, or HOST:PORT."""
        self.servers[name] = self.loop.run(start_orchestrator(
            self.address(verifier) if verifier in self.servers else verifier,
            self.address(drafter) if drafter else None, self.paths["target"], connect=connect, **cfg))
        return self.servers[name]

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.servers[name][0].port}"

    def servicer(self, name: str):
        return self.servers[name][1]

    def stop(self, name: str) -> None:
        server, _ = self.servers.pop(name)
        self.loop.run(server.stop())

    def open_sessions(self, *names: str) -> dict[str, int]:
        """Sessions open on the named verifier / drafter servicers."""
        return {name: len(self.servicer(name).sessions) for name in names}

    def wait_sessions(self, *names: str, count: int, timeout: float = 10.0) -> dict[str, int]:
        """Poll until each named servicer holds ``count`` sessions (or time runs out)."""
        deadline = time.monotonic() + timeout
        while True:
            counts = self.open_sessions(*names)
            if all(c == count for c in counts.values()) or time.monotonic() > deadline:
                return counts
            time.sleep(0.01)

    def wait_sessions_closed(self, *names: str, timeout: float = 10.0) -> dict[str, int]:
        return self.wait_sessions(*names, count=0, timeout=timeout)

    @contextlib.contextmanager
    def openai(self, name: str):
        """Orchestrator ``name``'s OpenAI-compatible API, started for the block:
        yields ``post(**body)``, the first choice of a ``/v1/completions`` answer
        (an error status raises ``urllib.error.HTTPError``)."""
        from orchestrator.http import HttpConfig
        from orchestrator.http_server import start_http

        http = self.loop.run(start_http(self.servicer(name), HttpConfig()))

        def post(**body):
            req = urllib.request.Request(f"{http.url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                return json.loads(resp.read())["choices"][0]

        try:
            yield post
        finally:
            self.loop.run(http.stop())

    @contextlib.contextmanager
    def prepared_batches(self, drafter: str):
        """The sizes of the batches drafter ``drafter``'s ``prepare`` (a batched
        first level) sees during the block."""
        engine = self.servicer(drafter).drafter
        sizes: list[int] = []
        prepare = engine.prepare
        engine.prepare = lambda sids: (sizes.append(len(sids)), prepare(sids))[1]
        try:
            yield sizes
        finally:
            engine.prepare = prepare

    def close(self) -> None:
        for name in reversed(list(self.servers)):   # orchestrators before their backends
            self.stop(name)
        self.loop.close()


def complete_concurrently(client, prompts: list[str], max_new_tokens: int, method: str):
    """Each prompt's completion, all of them at once through ``client``."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: client.complete(p, max_new_tokens=max_new_tokens, method=method), prompts))


class Tap:
    """Wraps one engine method: records the session id of each call and, while
    closed, holds the calls past a budget (``close(after=k)`` lets k more through)."""

    def __init__(self, engine, method: str):
        self.engine, self.method = engine, method
        self.original = getattr(engine, method)
        self.call = self.original          # what a let-through call runs
        self.sessions: list[str] = []
        self.held = 0                      # calls waiting at the tap now
        self._limit: int | None = None
        self._cond = threading.Condition()

        def tapped(sid, *args, **kw):
            with self._cond:
                self.sessions.append(sid)
                if self._limit is not None and len(self.sessions) > self._limit:
                    self.held += 1
                    self._cond.wait_for(lambda: self._limit is None, timeout=30)
                    self.held -= 1
            return self.call(sid, *args, **kw)

        setattr(engine, method, tapped)

    def close(self, after: int = 0) -> None:
        with self._cond:
            self._limit = len(self.sessions) + after

    def open(self) -> None:
        with self._cond:
            self._limit = None
            self._cond.notify_all()

    def restore(self) -> None:
        self.open()
        setattr(self.engine, self.method, self.original)
