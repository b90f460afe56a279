"""Service processes on this machine: start them, wait until they serve, stop them.

``specdec up`` and ``specdec bench --grpc`` both run verifier, drafter and
orchestrator processes on 127.0.0.1. Each child is ``python -m MODULE ARGV``
in a session of its own (so a Ctrl-C reaches the parent, which stops the
children in order); its port comes from the ``{"event": "listening", ...}``
line it prints on stdout, and it is ready once its health service reports
SERVING for "readiness". ``stop`` sends SIGTERM to every child and waits,
ignoring a repeated Ctrl-C or SIGTERM meanwhile.

The cores of the host are split among the torch processes
(``threads_per_process``); a lone verifier may take them all while one
session alternates between drafter and verifier (``solo_threads``). A
pinned run (``specdec bench --grpc --pin``) gives the verifier and the
drafter one core each (``pinned_cores``, ``spawn(cores=...)``), as on
devices of their own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


class ChildDied(Exception):
    """A child exited (or never got ready) while it was needed."""


@dataclass
class Child:
    """A started service process; ``port`` once it has said where it listens."""

    name: str
    proc: subprocess.Popen
    port: int | None = None
    lines: list[str] = field(default_factory=list)
    http_port: int | None = None       # the orchestrator's OpenAI-compatible API, if served

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def pinned_cores() -> tuple[int, int]:
    """(the verifier's core, the drafter's core) of a pinned run: the first two
    CPUs this process may use; ValueError when it may use fewer."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ValueError(f"pinning the verifier and the drafter to cores of their own needs 2 CPUs, "
                         f"this process may use {len(cores)}")
    return cores[0], cores[1]


def threads_per_process(torch_processes: int) -> int:
    """Split this host's cores among the torch processes ``up`` starts: the
    drafter and verifier compute at the same time once requests overlap, and
    oversubscribed OpenMP threads spin on each other (measured on 2 cores:
    eagle2 at 2 concurrent requests fell from 86 to 17 tokens/s with 2 threads
    each, and rose to 110 with 1 each)."""
    return max(1, (os.cpu_count() or 1) // max(1, torch_processes))


# libgomp's spin before an idle OpenMP worker sleeps. Its default (300,000
# spins) keeps a verifier's idle workers busy for about a millisecond after
# each forward, on the cores the drafter and orchestrator need next; far
# shorter spins make every barrier inside a forward a futex wake-up (on 2
# cores, 1,000 spins cut eagle2 through the services from 1.05x to 0.82x).
SOLO_SPINCOUNT = "30000"
# how long `up`, `soak` and `bench --grpc` wait for their services to be ready: a first start of a real
# model builds its compiled graphs (SmolLM2 in bf16 with an EAGLE-3 head: ~30 packages, ~1 min each here),
# and a child that dies is seen at once whatever the wait
STARTUP_TIMEOUT_S = 1800.0


def solo_threads(share: int, torch_processes: int) -> int:
    """``--solo-threads`` for a verifier given ``share`` of this host's cores:
    all of them when it is the one verifier among several torch processes (a
    lone session alternates between drafter and verifier, so one of them
    computes at a time), 0 (off) otherwise or when OMP_NUM_THREADS is the
    user's."""
    cores = os.cpu_count() or 1
    if "OMP_NUM_THREADS" in os.environ or torch_processes < 2 or share >= cores:
        return 0
    return cores


def solo_env() -> dict[str, str]:
    """What a process running with ``--solo-threads`` is spawned with."""
    return {"GOMP_SPINCOUNT": SOLO_SPINCOUNT}


def feature_layer_flags(eagle_head: str | None, compile_mode: str) -> list[str]:
    """``--compile-feature-layers`` for a compiled verifier whose drafter runs
    ``eagle_head`` when that is an EAGLE-3 head (its sessions' forwards then
    return feature layers, compiled too); else nothing."""
    if eagle_head is None or compile_mode == "off":
        return []
    from drafter.eagle.eagle3 import is_eagle3_head  # torch: only for a compiled EAGLE stack

    return ["--compile-feature-layers"] if is_eagle3_head(eagle_head) else []


def spawn(name: str, argv: list[str], module: str = "specdec.cli.main", threads: int | None = None,
          env_defaults: dict[str, str] | None = None, cores: frozenset[int] | None = None) -> Child:
    """Start ``python -m module *argv``; ``threads``: its OMP_NUM_THREADS unless
    the user set one; ``env_defaults``: variables it gets unless already set;
    ``cores``: the only CPUs it (and every thread it starts) may run on."""
    cmd = [sys.executable, "-m", module, *argv]
    env = dict(os.environ)
    if threads is not None and "OMP_NUM_THREADS" not in os.environ:   # the user's setting wins
        env["OMP_NUM_THREADS"] = str(threads)
    for key, value in (env_defaults or {}).items():
        env.setdefault(key, value)                                    # here too
    # A session of its own: Ctrl-C reaches `up`, which stops the children in order.
    pin = None if cores is None else (lambda: os.sched_setaffinity(0, cores))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True, env=env, preexec_fn=pin)
    child = Child(name, proc)
    threading.Thread(target=read_stdout, args=(child,), daemon=True).start()
    return child


def read_stdout(child: Child) -> None:
    """Keep the child's stdout lines; note its port from the "listening" line."""
    for line in child.proc.stdout:
        child.lines.append(line)
        if child.port is None:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and record.get("event") == "listening":
                child.http_port = record.get("http_port")
                child.port = int(record["port"])


def check_alive(children: list[Child]) -> None:
    """ChildDied naming the first child that has exited."""
    for child in children:
        code = child.proc.poll()
        if code is not None:
            raise ChildDied(f"the {child.name} exited with status {code}")


def wait_listening(children: list[Child], deadline: float) -> None:
    """Until every child has printed its port (ChildDied past ``deadline`` or when one exits)."""
    while any(c.port is None for c in children):
        check_alive(children)
        if time.monotonic() > deadline:
            raise ChildDied("timed out waiting for " + ", ".join(c.name for c in children if c.port is None))
        time.sleep(0.05)


def wait_serving(children: list[Child], deadline: float) -> None:
    """Until every child's health service reports SERVING for "readiness"."""

    pending = list(children)
    channels = {c.name: grpc.insecure_channel(c.address) for c in children}
    try:
        while pending:
            check_alive(children)
            if time.monotonic() > deadline:
                raise ChildDied("timed out waiting for " + ", ".join(c.name for c in pending) + " to be ready")
            for child in list(pending):
                stub = health_pb2_grpc.HealthStub(channels[child.name])
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=1.0).status
                except grpc.RpcError:
                    continue
                if status == health_pb2.HealthCheckResponse.SERVING:
                    pending.remove(child)
            time.sleep(0.1)
    finally:
        for channel in channels.values():
            channel.close()


def ignore_stop_signals() -> dict:
    """Ignore Ctrl-C and SIGTERM (main thread only) -> the handlers they had."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}


def stop(children: list[Child], timeout: float = 10.0) -> None:
    """SIGTERM every child, then wait (SIGKILL past ``timeout``). A second
    Ctrl-C or SIGTERM meanwhile (a supervisor repeating itself) is ignored:
    raised in the middle, it would leave the children running."""
    held = ignore_stop_signals()
    try:
        for child in children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in children:
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)
