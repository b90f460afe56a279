"""The processes a soak starts, kills and restarts.

Like ``specdec up``, but every process listens on a port chosen once, up
front: a verifier or drafter killed and restarted comes back at the address
the orchestrator already knows, and a restarted orchestrator at the address
the clients use. Readiness is the ``--ready-file`` each server writes once
its model is loaded and warmed up. Each process's output goes to a log file
in the soak's work directory (named in the report when a process dies on
its own).

    stack = SoakStack(models, verifiers=1, drafters=1, workdir=tmp)
    stack.start(timeout_s=300)
    stack.kill_and_restart("drafter")
    stack.stop()
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdec.procs import threads_per_process

ROLES = ("verifier", "drafter", "orchestrator")


class StackError(Exception):
    """A process did not come up (its log file says why)."""


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports bound to 0 (Linux's default if unreadable)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port nothing listens on right now, on 127.0.0.1, outside the ephemeral range.

    The soak keeps its ports for restarts, so it picks them itself. Every
    other server (tests beside the soak included) binds port 0 and gets one
    from the kernel's ephemeral range; choosing below or above that range
    means none of them can take a soak port between picking and binding.
    """
    low, high = _ephemeral_range()
    spans = [span for span in ((10000, low - 1), (high + 1, 65535)) if span[1] - span[0] > 100]
    rng = random.Random()
    for _ in range(200):
        first, last = rng.choice(spans) if spans else (1024, 65535)
        port = rng.randint(first, last)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise StackError("no free port outside the ephemeral range on 127.0.0.1")


@dataclass(frozen=True)
class Models:
    """What the backends serve: flags of ``specdec verifier serve`` / ``drafter serve``."""

    verifier_argv: tuple[str, ...]
    drafter_argv: tuple[str, ...]
    tokenizer: str


@dataclass
class ServiceProcess:
    """One server process: its role, fixed port, command line and current pid."""

    role: str
    name: str
    port: int
    argv: list[str]
    module: str
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    starts: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def ready_file(self) -> Path:
        return self.workdir / f"{self.name}.ready"

    @property
    def log_file(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.ready_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", self.module, *self.argv, "--port", str(self.port),
               "--ready-file", str(self.ready_file)]
        with open(self.log_file, "a") as log:
            log.write(f"--- start {self.starts + 1}: {' '.join(cmd)}\n")
            log.flush()
            # a session of its own: a Ctrl-C meant for the soak reaches the soak only
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **self.env}, start_new_session=True)
        self.starts += 1

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            if not self.alive():
                raise StackError(f"the {self.name} exited with status {self.proc.returncode} "
                                 f"(see {self.log_file})")
            if time.monotonic() > deadline:
                raise StackError(f"the {self.name} was not ready after {timeout_s:.0f} s (see {self.log_file})")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as an OOM killer or a node failure would."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        if not self.alive():
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()


class SoakStack:
    """M verifiers, N drafters and one orchestrator pointed at all of them."""

    def __init__(self, models: Models, verifiers: int, drafters: int, workdir: Path, log_level: str = "WARNING",
                 orchestrator_argv: tuple[str, ...] = ()):
        if verifiers < 1 or drafters < 0:
            raise ValueError(f"need at least one verifier and no negative drafter count, got {verifiers} "
                             f"and {drafters}")
        threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")
                   or str(threads_per_process(verifiers + drafters))}
        server = ["--host", "127.0.0.1", "--metrics-port", "off", "--drain-s", "1", "--log-level", log_level]
        main = "specdec.cli.main"
        self.verifiers = [ServiceProcess("verifier", _name("verifier", i, verifiers), free_port(),
                                         ["verifier", "serve", *models.verifier_argv, *server], main, workdir,
                                         threads)
                          for i in range(verifiers)]
        self.drafters = [ServiceProcess("drafter", _name("drafter", i, drafters), free_port(),
                                        ["drafter", "serve", *models.drafter_argv, *server], main, workdir, threads)
                         for i in range(drafters)]
        orch = ["orchestrator", "serve", "--verifier", ",".join(p.address for p in self.verifiers),
                "--tokenizer", models.tokenizer, "--probe-interval-s", "0.5", *orchestrator_argv, *server]
        if self.drafters:
            orch += ["--drafter", ",".join(p.address for p in self.drafters)]
        # the torch-free entry point, as `specdec up` starts it
        self.orchestrator = ServiceProcess("orchestrator", "orchestrator", free_port(), orch, "specdec.cli.stack",
                                           workdir)

    @property
    def processes(self) -> list[ServiceProcess]:
        return [*self.verifiers, *self.drafters, self.orchestrator]

    @property
    def backends(self) -> list[ServiceProcess]:
        return [*self.verifiers, *self.drafters]

    def start(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for p in self.backends:
            p.start()
        for p in self.backends:
            p.wait_ready(max(1.0, deadline - time.monotonic()))
        self.orchestrator.start()
        self.orchestrator.wait_ready(max(1.0, deadline - time.monotonic()))

    def of_role(self, role: str) -> list[ServiceProcess]:
        return {"verifier": self.verifiers, "drafter": self.drafters, "orchestrator": [self.orchestrator]}[role]

    def kill_and_restart(self, process: ServiceProcess, timeout_s: float, down_s: float = 0.0) -> float:
        """SIGKILL ``process``, wait ``down_s``, start it again on its port and wait
        until it is ready -> seconds it was away."""
        start = time.monotonic()
        process.kill()
        time.sleep(down_s)
        process.start()
        process.wait_ready(timeout_s)
        return time.monotonic() - start

    def dead(self) -> list[ServiceProcess]:
        """Processes that exited on their own (not being restarted by the soak)."""
        return [p for p in self.processes if p.proc is not None and not p.alive()]

    def stop(self) -> None:
        # the orchestrator first: it releases its sessions while the backends still answer
        for p in [self.orchestrator, *self.backends]:
            p.stop()


def _name(role: str, index: int, count: int) -> str:
    return role if count == 1 else f"{role}-{index + 1}"
