"""``specdec orchestrator serve`` and ``specdec up`` (the whole stack on one machine).

``specdec orchestrator serve --verifier HOST:PORT [--drafter HOST:PORT]``
serves the public API. Backends come from static lists (``--verifier`` and
``--drafter``, repeatable or comma-separated; SPECDEC_VERIFIER /
SPECDEC_DRAFTER) and / or the DNS names of headless Services
(``--verifier-dns HOST:PORT``, ``--drafter-dns HOST:PORT``; re-resolved every
``--resolve-interval-s``, probed every ``--probe-interval-s``); see
``orchestrator.routing``. Server flags as in ``specdec.cli.serve`` (--host,
--port, --metrics-port, --auth-token, --tls-*, --drain-s, --log-level,
--ready-file, with their SPECDEC_* variables); calls to the backends use
--backend-ca / --backend-cert / --backend-key (mutual TLS) and
--backend-token (SPECDEC_BACKEND_TOKEN). Readiness comes once a verifier
answers (and a drafter, if any is configured, or a minute later).

``python -m specdec.cli.stack orchestrator serve ...`` is the same command
without the rest of the CLI, so the orchestrator process never imports torch
(``specdec up`` starts it that way).

``specdec up`` starts ``--verifiers M`` verifiers, ``--drafters N`` drafters
(default one each) and an orchestrator pointed at all of them, as processes
on 127.0.0.1 (internal ports chosen free; the host's cores are split among
the verifier and drafter processes unless OMP_NUM_THREADS is set, and a lone
verifier takes them all while at most one session is open: ``--solo-threads``,
off when SPECDEC_LOOKAHEAD makes the drafter draft during verifies), waits
until all report SERVING,
prints one line saying where they are (and writes ``--state FILE``: JSON with
the orchestrator's address and each backend's address and pid), and stops
them all on Ctrl-C / SIGTERM. A child that dies while starting ends ``up``
(exit status 1, naming it); once running, a verifier or drafter that dies is
only reported, since the orchestrator fails over to the others: only the
orchestrator dying ends ``up`` (status 1). ``--demo-generation`` streams one
generation through the SDK once ready.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdec import knobs
from specdec.cli.http_flags import add_http_flags, add_up_http_flag, http_config_from, up_http_port
from specdec.cli.serve import add_server_flags, server_config_from
from specdec.params import METHODS, REQUEST_METHODS, VANILLA, TreeParams

ORCHESTRATOR_PORTS = (50051, 9451)    # (gRPC, metrics) defaults
DEMO_PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def _min_tau(text: str) -> float | None:
    try:
        return knobs.parse_min_tau(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _env(name: str, default=None):
    value = os.environ.get(name)
    return default if value is None or value == "" else value


# -- specdec orchestrator serve ------------------------------------------------------------
def add_parsers(sub) -> None:
    add_orchestrator_parser(sub)
    u = sub.add_parser("up", help="verifier + drafter + orchestrator on this machine, one command")
    add_up_flags(u)
    u.set_defaults(run=run_up)


def add_orchestrator_parser(sub) -> None:
    o = sub.add_parser("orchestrator", help="the orchestrator service (public API)")
    p = o.add_subparsers(dest="orchestrator_command", required=True).add_parser(
        "serve", help="serve OrchestratorService over gRPC")
    d = p.add_argument_group("backends (static lists and / or headless-Service DNS names; see orchestrator.routing)")
    d.add_argument("--verifier", metavar="HOST:PORT", action="append",
                   help="verifier service; repeat or comma-separate for several (env SPECDEC_VERIFIER, "
                        "comma-separated); required unless --verifier-dns is given")
    d.add_argument("--drafter", metavar="HOST:PORT", action="append",
                   help="drafter service; repeat or comma-separate for several (env SPECDEC_DRAFTER); "
                        "none: plain decoding on the verifiers")
    d.add_argument("--verifier-dns", metavar="HOST:PORT", default=_env("SPECDEC_VERIFIER_DNS"),
                   help="DNS name of the verifiers' headless Service: every address it resolves to "
                        "(env SPECDEC_VERIFIER_DNS)")
    d.add_argument("--drafter-dns", metavar="HOST:PORT", default=_env("SPECDEC_DRAFTER_DNS"),
                   help="DNS name of the drafters' headless Service (env SPECDEC_DRAFTER_DNS)")
    d.add_argument("--resolve-interval-s", type=float, metavar="S", default=_env("SPECDEC_RESOLVE_INTERVAL_S", 10.0),
                   help="resolve the DNS names again this often; vanished addresses are drained "
                        "(env SPECDEC_RESOLVE_INTERVAL_S; default 10)")
    d.add_argument("--probe-interval-s", type=float, metavar="S", default=_env("SPECDEC_PROBE_INTERVAL_S", 2.0),
                   help="ask every backend for GetInfo (health, capacity) this often "
                        "(env SPECDEC_PROBE_INTERVAL_S; default 2)")
    p.add_argument("--tokenizer", metavar="DIR", help="directory with tokenizer.json (default: the demo target)")
    t = p.add_argument_group("defaults of a request's 0 / unset knobs (clamped to the drafter's limits)")
    t.add_argument("--method", default=knobs.DEFAULT_METHOD, choices=METHODS)
    t.add_argument("--total-tokens", type=int, default=knobs.DEFAULT_TOTAL_TOKENS)
    t.add_argument("--depth", type=int, default=knobs.DEFAULT_DEPTH)
    t.add_argument("--expand-k", type=int, default=knobs.DEFAULT_EXPAND_K)
    t.add_argument("--max-new-tokens", type=int, default=128)
    t.add_argument("--min-tau", type=_min_tau, metavar="TAU", default=_env("SPECDEC_MIN_TAU", "auto"),
                   help="pause a session's drafting while its recent cycles commit fewer tokens than this on "
                        f"average (0 = always draft; auto, the default: {knobs.DEFAULT_MIN_TAU:g}, "
                        f"{knobs.NGRAM_MIN_TAU:g} with an n-gram drafter; env SPECDEC_MIN_TAU)")
    t.add_argument("--lookahead", type=int, metavar="N", default=_env("SPECDEC_LOOKAHEAD", knobs.DEFAULT_LOOKAHEAD),
                   help="greedy sessions: while the verifier checks a tree, the drafter drafts the next round "
                        "for the N likeliest accepted paths, and a hit skips the next Draft round trip "
                        "(0 = off; at most 8; env SPECDEC_LOOKAHEAD)")
    t.add_argument("--verify-token-budget", type=int, metavar="N", default=_env("SPECDEC_VERIFY_TOKEN_BUDGET", 0),
                   help="tree nodes per verifier step over all its sessions: each session's tree is cut to "
                        "N / sessions (at least 4) under load (0 = off; env SPECDEC_VERIFY_TOKEN_BUDGET)")
    t.add_argument("--max-new-tokens-limit", type=int, default=2048, help="larger requests: INVALID_ARGUMENT")
    b = p.add_argument_group("calls to the backends")
    b.add_argument("--backend-ca", default=_env("SPECDEC_BACKEND_CA"), help="CA of the backends' certificates (TLS)")
    b.add_argument("--backend-cert", default=_env("SPECDEC_BACKEND_CERT"), help="client certificate (mutual TLS)")
    b.add_argument("--backend-key", default=_env("SPECDEC_BACKEND_KEY"), help="client key (mutual TLS)")
    b.add_argument("--backend-token", default=_env("SPECDEC_BACKEND_TOKEN"), help="bearer token for the backends")
    add_server_flags(p, *ORCHESTRATOR_PORTS)
    add_http_flags(p)
    p.set_defaults(run=run_orchestrator)


def orchestrator_config(args):
    from orchestrator.routing import parse_addresses, split_address
    from orchestrator.service import OrchestratorConfig
    from specdec.cli.main import CliError
    from specdec.server import ClientTls

    try:
        verifiers = parse_addresses(args.verifier or _env("SPECDEC_VERIFIER"))
        drafters = parse_addresses(args.drafter or _env("SPECDEC_DRAFTER"))
        for flag in ("verifier_dns", "drafter_dns"):
            if getattr(args, flag):
                split_address(getattr(args, flag))
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if not verifiers and not args.verifier_dns:
        raise CliError("--verifier HOST:PORT or --verifier-dns HOST:PORT is required "
                       "(or SPECDEC_VERIFIER / SPECDEC_VERIFIER_DNS)")
    if not 0 <= args.lookahead <= 8:
        raise CliError(f"--lookahead must be in [0, 8] (0 = off), got {args.lookahead}")
    for flag in ("resolve_interval_s", "probe_interval_s"):
        if not getattr(args, flag) > 0:
            raise CliError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    tls = None
    if args.backend_ca or args.backend_cert or args.backend_key:
        tls = ClientTls(ca=args.backend_ca, cert=args.backend_cert, key=args.backend_key)
    tree = TreeParams(method=args.method, total_tokens=args.total_tokens, depth=args.depth,
                      expand_k=args.expand_k)
    return OrchestratorConfig(verifier=verifiers, drafter=drafters, verifier_dns=args.verifier_dns or None,
                              drafter_dns=args.drafter_dns or None, resolve_interval_s=args.resolve_interval_s,
                              probe_interval_s=args.probe_interval_s, tree=tree,
                              default_max_new_tokens=args.max_new_tokens,
                              max_new_tokens_limit=args.max_new_tokens_limit, backend_tls=tls,
                              backend_token=args.backend_token, verify_token_budget=args.verify_token_budget,
                              min_tau=args.min_tau, lookahead=args.lookahead)


def run_orchestrator(args) -> int:
    from orchestrator.service import OrchestratorService
    from orchestrator.text import TextTokenizer
    from specdec.cli.main import CliError
    from specdec.models import demo_path
    from specdec.server import configure_logging

    config = orchestrator_config(args)
    cfg = server_config_from(args)
    tokenizer_dir = args.tokenizer or demo_path("target")
    tokenizer = TextTokenizer.load(tokenizer_dir)
    http = http_config_from(args, cfg, tokenizer_dir)
    configure_logging("orchestrator", args.log_level)
    servicer = OrchestratorService(config, tokenizer)
    try:
        asyncio.run(_serve_orchestrator(cfg, servicer, args.ready_file, http))
    except OSError as exc:
        raise CliError(str(exc)) from None
    return 0


async def _serve_orchestrator(cfg, servicer, ready_file: str | None, http=None) -> None:
    """Listen at once (gRPC, and HTTP with ``http``), go ready when the
    backends answer; a SIGTERM while waiting for them stops the server too."""
    from orchestrator.http_server import start_http
    from specdec.server import start_server

    server = await start_server(cfg, [servicer.registration()], "orchestrator")
    try:
        http_server = None if http is None else await start_http(servicer, http)
    except OSError:
        await server.stop(None)
        raise
    try:
        await _serve_until_stopped(server, servicer, ready_file, http_server, cfg.drain_s)
    finally:
        if http_server is not None:
            await http_server.stop()


async def _serve_until_stopped(server, servicer, ready_file: str | None, http_server, drain_s: float) -> None:
    from specdec.server import install_signal_drain

    record = server.listening_record()
    if http_server is not None:
        record["http_port"] = http_server.port
    print(json.dumps(record), flush=True)
    install_signal_drain(server, drain_s)
    connect = asyncio.create_task(servicer.connect())
    stopped = asyncio.create_task(server.wait())
    await asyncio.wait([connect, stopped], return_when=asyncio.FIRST_COMPLETED)
    if not connect.done():
        connect.cancel()
        return
    if connect.exception() is not None:
        await server.stop(None)
        raise connect.exception()
    if not server.stopping:
        server.set_ready(True)
        if ready_file:
            tmp = Path(f"{ready_file}.tmp")
            tmp.write_text(json.dumps(record) + "\n")
            tmp.replace(ready_file)
    await stopped


# -- specdec up ----------------------------------------------------------------------------
def add_up_flags(p: argparse.ArgumentParser) -> None:
    from specdec.cli.generate import add_model_flags

    p.add_argument("--port", type=int, default=ORCHESTRATOR_PORTS[0], help="orchestrator port (0 = any free port)")
    p.add_argument("--metrics-port", default="0", help="orchestrator metrics port (0 = any free port, 'off')")
    add_up_http_flag(p)
    add_model_flags(p)
    p.add_argument("--method", default=knobs.DEFAULT_METHOD, choices=REQUEST_METHODS,
                   help="default tree method (vanilla: no drafter process)")
    p.add_argument("--demo-generation", action="store_true",
                   help="once ready, stream one generation of a built-in prompt with its stats")
    p.add_argument("--exit-after-demo", action="store_true", help="stop the stack after the demo generation")
    p.add_argument("--demo-max-new-tokens", type=int, default=128)
    p.add_argument("--verifiers", type=int, default=1, metavar="M", help="verifier processes (default 1)")
    p.add_argument("--drafters", type=int, default=1, metavar="N",
                   help="drafter processes (default 1; 0 or --method vanilla: none, plain decoding)")
    p.add_argument("--state", metavar="FILE",
                   help="once all are ready, write JSON {orchestrator, drafters: [{addr, pid}], verifiers: [...]} "
                        "here (removed on exit)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for all to be ready")
    p.add_argument("--log-level", default="WARNING", type=str.upper,
                   choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log level of the services")


class ChildDied(Exception):
    pass


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    port: int | None = None
    lines: list[str] = field(default_factory=list)
    http_port: int | None = None       # the orchestrator's OpenAI-compatible API, if served

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


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


def _drafts_ahead() -> bool:
    """Whether the orchestrator ``up`` starts will draft ahead (SPECDEC_LOOKAHEAD,
    which it inherits): its drafter then computes during verifies, so the
    verifier gets no solo threads."""
    try:
        return int(_env("SPECDEC_LOOKAHEAD", knobs.DEFAULT_LOOKAHEAD)) != 0
    except ValueError:
        return True                      # the orchestrator reports the bad value


def solo_env() -> dict[str, str]:
    """What a process running with ``--solo-threads`` is spawned with."""
    return {"GOMP_SPINCOUNT": SOLO_SPINCOUNT}


def _spawn(name: str, argv: list[str], module: str = "specdec.cli.main", threads: int | None = None,
           env_defaults: dict[str, str] | None = None) -> Child:
    cmd = [sys.executable, "-m", module, *argv]
    env = dict(os.environ)
    if threads is not None and "OMP_NUM_THREADS" not in os.environ:   # the user's setting wins
        env["OMP_NUM_THREADS"] = str(threads)
    for key, value in (env_defaults or {}).items():
        env.setdefault(key, value)                                    # here too
    # A session of its own: Ctrl-C reaches `up`, which stops the children in order.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True, env=env)
    child = Child(name, proc)
    threading.Thread(target=_read_stdout, args=(child,), daemon=True).start()
    return child


def _read_stdout(child: Child) -> None:
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


def _check_alive(children: list[Child]) -> None:
    for child in children:
        code = child.proc.poll()
        if code is not None:
            raise ChildDied(f"the {child.name} exited with status {code}")


def _names(role: str, count: int) -> list[str]:
    return [role] if count == 1 else [f"{role}-{i}" for i in range(1, count + 1)]


def _write_state(path: str, orchestrator: Child, verifiers: list[Child], drafters: list[Child]) -> None:
    def entries(children):
        return [{"addr": c.address, "pid": c.proc.pid} for c in children]

    state = {"orchestrator": orchestrator.address, "drafters": entries(drafters), "verifiers": entries(verifiers)}
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(state) + "\n")
    tmp.replace(path)


def _watch(orchestrator: Child, backends: list[Child]) -> None:
    """Until the orchestrator dies (ChildDied): report each backend that dies, once."""
    def role(child: Child) -> str:
        return child.name.split("-")[0]

    reported: set[str] = set()
    while True:
        _check_alive([orchestrator])
        for child in backends:
            code = child.proc.poll()
            if code is None or child.name in reported:
                continue
            reported.add(child.name)
            left = sum(1 for c in backends if role(c) == role(child) and c.proc.poll() is None)
            print(f"specdec up: the {child.name} (pid {child.proc.pid}) exited with status {code}; "
                  f"{left} {role(child)}(s) left, going on", file=sys.stderr, flush=True)
        time.sleep(0.2)


def _wait_listening(children: list[Child], deadline: float) -> None:
    while any(c.port is None for c in children):
        _check_alive(children)
        if time.monotonic() > deadline:
            raise ChildDied("timed out waiting for " + ", ".join(c.name for c in children if c.port is None))
        time.sleep(0.05)


def _wait_serving(children: list[Child], deadline: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    pending = list(children)
    channels = {c.name: grpc.insecure_channel(c.address) for c in children}
    try:
        while pending:
            _check_alive(children)
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


def _ignore_stop_signals() -> dict:
    """Ignore Ctrl-C and SIGTERM (main thread only) -> the handlers they had."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}


def _stop(children: list[Child], timeout: float = 10.0) -> None:
    """SIGTERM every child, then wait (SIGKILL past ``timeout``). A second
    Ctrl-C or SIGTERM meanwhile (a supervisor repeating itself) is ignored:
    raised in the middle, it would leave the children running."""
    held = _ignore_stop_signals()
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


def _model_argv(args) -> tuple[list[str], list[str] | None, str]:
    """Flags for the verifier, for the drafter (None: no drafter) and the tokenizer directory."""
    from specdec.models import demo_path

    target = _model_dir(args.target or str(demo_path("target")), "target model")
    verifier = ["--target", target, "--dtype", args.dtype]
    if args.method == VANILLA:
        drafter = None
    elif args.ngram:
        drafter = ["--ngram", "--target", target]
    elif args.draft_lm:
        drafter = ["--draft-lm", _model_dir(args.draft_lm, "draft LM"), "--dtype", args.dtype]
    else:
        eagle = _model_dir(args.eagle or str(demo_path("eagle")), "EAGLE head")
        drafter = ["--eagle", eagle, "--target", target, "--dtype", args.dtype]
    return verifier, drafter, target


def _model_dir(path: str, what: str) -> str:
    from specdec.cli.main import CliError

    if not Path(path, "config.json").is_file():
        raise CliError(f"{what} directory {path} has no config.json")
    return path


def run_up(args) -> int:
    from specdec.cli.main import CliError

    if args.demo_max_new_tokens < 1:
        raise CliError(f"--demo-max-new-tokens must be >= 1, got {args.demo_max_new_tokens}")
    if args.verifiers < 1:
        raise CliError(f"--verifiers must be >= 1, got {args.verifiers}")
    if args.drafters < 0:
        raise CliError(f"--drafters must be >= 0, got {args.drafters}")
    verifier_argv, drafter_argv, tokenizer = _model_argv(args)
    if args.drafters == 0:
        drafter_argv = None
    internal = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--drain-s", "2",
                "--log-level", args.log_level]

    def on_sigterm(signum, frame):
        _ignore_stop_signals()               # stopping from here on: a repeated signal must not cut it short
        raise KeyboardInterrupt

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, on_sigterm)
    if args.state:
        Path(args.state).unlink(missing_ok=True)      # a stale file must not pass for this stack's
    children: list[Child] = []
    try:
        deadline = time.monotonic() + args.startup_timeout
        torch_processes = args.verifiers + (0 if drafter_argv is None else args.drafters)
        threads = threads_per_process(torch_processes)
        solo = solo_threads(threads, torch_processes) if args.verifiers == 1 and not _drafts_ahead() else 0
        solo_argv, env = (["--solo-threads", str(solo)], solo_env()) if solo else ([], None)
        verifiers = [_spawn(name, ["verifier", "serve", *verifier_argv, *solo_argv, *internal], threads=threads,
                            env_defaults=env)
                     for name in _names("verifier", args.verifiers)]
        drafters = [] if drafter_argv is None else [
            _spawn(name, ["drafter", "serve", *drafter_argv, *internal], threads=threads)
            for name in _names("drafter", args.drafters)]
        children += verifiers + drafters
        _wait_listening(children, deadline)
        orch_argv = ["orchestrator", "serve", "--verifier", ",".join(c.address for c in verifiers),
                     "--tokenizer", tokenizer, "--host", "127.0.0.1", "--port", str(args.port),
                     "--metrics-port", str(args.metrics_port), "--drain-s", "2", "--log-level", args.log_level]
        http_port = up_http_port(args)
        if http_port is not None:
            orch_argv += ["--http-port", str(http_port)]
        if drafters:
            orch_argv += ["--drafter", ",".join(c.address for c in drafters), "--method", args.method]
        orchestrator = _spawn("orchestrator", orch_argv, module="specdec.cli.stack")
        children.append(orchestrator)
        _wait_listening(children, deadline)
        _wait_serving(children, deadline)
        if args.state:
            _write_state(args.state, orchestrator, verifiers, drafters)
        where = ", ".join(f"{c.name} {c.address}" for c in verifiers + drafters)
        print(f"specdec up: orchestrator on {orchestrator.address} ({where})", flush=True)
        if orchestrator.http_port is not None:
            print(f"specdec up: OpenAI-compatible API on http://127.0.0.1:{orchestrator.http_port}/v1", flush=True)
        if args.demo_generation:
            _demo(orchestrator.address, args.demo_max_new_tokens)
            if args.exit_after_demo:
                return 0
        _watch(orchestrator, verifiers + drafters)
    except ChildDied as exc:
        print(f"specdec up: {exc}; stopping the others", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        _ignore_stop_signals()
        print("specdec up: stopping", file=sys.stderr, flush=True)
        return 0
    finally:
        _stop(children)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if args.state:
            Path(args.state).unlink(missing_ok=True)
    return 0


def _demo(address: str, max_new_tokens: int) -> None:
    from specdec.cli.main import CliError
    from specdec.client import SpecdecClient, SpecdecClientError

    with SpecdecClient(address, timeout=120.0) as client:
        try:
            stream = client.generate(DEMO_PROMPT, max_new_tokens=max_new_tokens)
            sys.stdout.write(DEMO_PROMPT)
            for chunk in stream:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        except SpecdecClientError as exc:
            raise CliError(f"demo generation failed: {exc}") from None
    s = stream.stats
    print(f"\n[{s.completion_tokens} tokens in {s.cycles} cycles, tau {s.tau:.2f}, {s.tokens_per_s:.1f} tok/s, "
          f"ttft {s.ttft_s * 1e3:.0f} ms; time split: draft {s.draft_s:.3f}s, verify {s.verify_s:.3f}s, "
          f"network {s.network_s:.3f}s, other {s.other_s:.3f}s"
          + (f"; trees drafted ahead: {s.ahead_hits} of {s.cycles}" if s.ahead_hits else "")
          + f"; finish: {s.finish_reason}]", flush=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m specdec.cli.stack orchestrator serve ...``: errors as in ``specdec``."""
    from specdec.cli.main import run_parsed

    parser = argparse.ArgumentParser(prog="specdec")
    add_orchestrator_parser(parser.add_subparsers(dest="command", required=True))
    return run_parsed(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
