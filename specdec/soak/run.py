"""The soak's schedule: references, load with kills, then the after-load checks.

1. References: each prompt decoded greedily, once with plain decoding
   (method VANILLA: the ground truth) and once speculatively, on the stack
   before anything disturbs it; the two must agree.
2. Load: ``clients`` clients for ``duration_s`` seconds; meanwhile the
   processes named in ``kills`` are killed (SIGKILL) one after another at
   evenly spaced times and restarted at once on the same port. Each kill
   opens a window, until the process is ready again plus ``grace_s``, in which
   UNAVAILABLE is an expected answer.
3. After the load: ``settle_s`` seconds later every backend's GetInfo must
   report no open session; each process's RSS is compared with its RSS when
   the load began (or when it was restarted).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

import grpc
import psutil

from specdec.client.sdk import build_request
from specdec.soak.load import PROMPTS, Client, Outcome, Window, judge
from specdec.soak.report import ProcessMemory, SoakReport
from specdec.soak.stack import SoakStack
from specdec.v1 import drafter_pb2, drafter_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc, verifier_pb2
from specdec.v1 import verifier_pb2_grpc

DEFAULT_KILLS = ("drafter", "verifier", "orchestrator") * 2
REFERENCE_TIMEOUT_S = 300.0


class SoakError(Exception):
    """The soak could not run (its references failed)."""


@dataclass(frozen=True)
class SoakConfig:
    clients: int = 16
    duration_s: float = 600.0
    kills: tuple[str, ...] = DEFAULT_KILLS      # roles, killed in this order at even intervals
    max_new_tokens: int = 48
    settle_s: float = 5.0                       # after the load, before counting open sessions
    grace_s: float = 3.0                        # after a restarted process is ready, UNAVAILABLE still expected
    max_rss_growth: float = 0.10
    seed: int = 0
    restart_timeout_s: float = 300.0

    def __post_init__(self):
        if self.clients < 1 or not self.duration_s > 0 or self.max_new_tokens < 1:
            raise ValueError(f"need clients >= 1, duration > 0 and max_new_tokens >= 1, got {self.clients}, "
                             f"{self.duration_s} and {self.max_new_tokens}")
        if not self.settle_s >= 0 or not self.grace_s >= 0 or not self.max_rss_growth > 0:
            raise ValueError("settle and grace times must be >= 0 and the RSS growth threshold > 0")


@dataclass(frozen=True)
class Backend:
    """A verifier or drafter to ask for its open sessions (and whose memory to watch)."""

    name: str
    role: str
    address: str
    pid: int | None = None


def rss_mb(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return 0.0


async def open_sessions(backend: Backend) -> int:
    """The backend's GetInfo ``active_sessions``; -1 when it does not answer."""
    async with grpc.aio.insecure_channel(backend.address) as channel:
        try:
            if backend.role == "verifier":
                info = await verifier_pb2_grpc.VerifierServiceStub(channel).GetInfo(
                    verifier_pb2.VerifierGetInfoRequest(), timeout=5.0)
            else:
                info = await drafter_pb2_grpc.DrafterServiceStub(channel).GetInfo(
                    drafter_pb2.DrafterGetInfoRequest(), timeout=5.0)
        except grpc.aio.AioRpcError:
            return -1
    return info.active_sessions


async def references(address: str, max_new_tokens: int) -> tuple[dict[int, list[int]], list[dict]]:
    """{prompt index: plain greedy tokens}, and the prompts whose speculative
    greedy output differs from them."""
    refs, disagreements = {}, []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        for i, prompt in enumerate(PROMPTS):
            outputs = []
            for method in ("vanilla", None):
                request = build_request(prompt, max_new_tokens=max_new_tokens, method=method,
                                        request_id=f"soak-reference-{i}")
                try:
                    response = await stub.Complete(orchestrator_pb2.CompleteRequest(request=request),
                                                   timeout=REFERENCE_TIMEOUT_S)
                except grpc.aio.AioRpcError as exc:
                    raise SoakError(f"the reference of prompt {i} ({method or 'speculative'}) failed: "
                                    f"{exc.code().name}: {exc.details()}") from None
                outputs.append(list(response.token_ids))
            refs[i] = outputs[0]
            if outputs[1] != outputs[0]:
                disagreements.append({"prompt": i, "plain": outputs[0], "speculative": outputs[1]})
    return refs, disagreements


class Soak:
    """One soak run against ``address``; ``stack`` (when the soak started it) is
    what gets killed and restarted."""

    def __init__(self, config: SoakConfig, address: str, backends: list[Backend], stack: SoakStack | None = None,
                 pids: dict[str, int] | None = None):
        self.config = config
        self.address = address
        self.backends = backends
        self.stack = stack
        self.pids = dict(pids or {})          # process name -> pid, for RSS
        self.windows: list[Window] = []
        self.kills: list[dict] = []
        self.rss_start: dict[str, float] = {}
        self.restarted: set[str] = set()

    async def run(self, progress=print) -> SoakReport:
        cfg = self.config
        report = SoakReport(settings={**asdict(cfg), "kills": list(cfg.kills), "target": self.address},
                            max_rss_growth=cfg.max_rss_growth)
        progress(f"references: {len(PROMPTS)} prompts, {cfg.max_new_tokens} tokens each")
        refs, report.reference_disagreements = await references(self.address, cfg.max_new_tokens)
        self.rss_start = {name: rss_mb(pid) for name, pid in self._pids().items()}
        progress(f"load: {cfg.clients} clients for {cfg.duration_s:g} s"
                 + (f", killing {', '.join(cfg.kills)}" if cfg.kills and self.stack else ""))
        start = time.monotonic()
        until = start + cfg.duration_s
        clients = [Client(i, self.address, cfg.seed, cfg.max_new_tokens) for i in range(cfg.clients)]
        chaos = asyncio.create_task(self._chaos(start, progress))
        results = await asyncio.gather(*(c.run(until) for c in clients))
        await chaos
        report.load_s = time.monotonic() - start
        outcomes: list[Outcome] = [o for r in results for o in r]
        report.outcomes = [judge(o, self.windows, refs) for o in outcomes]
        report.kills = self.kills
        progress(f"load done: {len(outcomes)} requests; checking sessions in {cfg.settle_s:g} s")
        await asyncio.sleep(cfg.settle_s)
        counts = await asyncio.gather(*(open_sessions(b) for b in self.backends))
        report.open_sessions = {b.name: n for b, n in zip(self.backends, counts)}
        end = {name: rss_mb(pid) for name, pid in self._pids().items()}
        report.memory = [ProcessMemory(name, self.rss_start.get(name, 0.0), end[name], name in self.restarted)
                         for name in end]
        if self.stack is not None:
            report.died = [p.name for p in self.stack.dead()]
        return report

    def _pids(self) -> dict[str, int]:
        if self.stack is None:
            return self.pids
        return {p.name: p.pid for p in self.stack.processes}

    async def _chaos(self, start: float, progress) -> None:
        """Kill and restart the processes of ``kills``, evenly spread over the load."""
        if self.stack is None or not self.config.kills:
            return
        kills = [role for role in self.config.kills if self.stack.of_role(role)]
        turns: dict[str, int] = {}
        for i, role in enumerate(kills):
            at = start + self.config.duration_s * (i + 1) / (len(kills) + 1)
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            replicas = self.stack.of_role(role)
            process = replicas[turns.get(role, 0) % len(replicas)]
            turns[role] = turns.get(role, 0) + 1
            progress(f"killing the {process.name} (pid {process.pid})")
            killed = time.monotonic()
            away = await asyncio.to_thread(self.stack.kill_and_restart, process, self.config.restart_timeout_s)
            back = time.monotonic()
            self.windows.append(Window(role, process.name, killed, back + self.config.grace_s))
            self.kills.append({"role": role, "name": process.name, "at_s": round(killed - start, 2),
                               "away_s": round(away, 2)})
            self.restarted.add(process.name)
            self.rss_start[process.name] = rss_mb(process.pid)
