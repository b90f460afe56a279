"""``specdec soak``: run the stack under a long, disturbed load and check nothing was lost or leaked.

By default it starts its own stack on 127.0.0.1 (``--verifiers M``,
``--drafters N``, the models of ``specdec up``), runs ``--clients C`` for
``--duration S`` seconds while killing (SIGKILL) and restarting the processes
listed in ``--kills``, prints a report (``--json FILE`` writes it as JSON)
and exits 1 on any loss or leak (``specdec.soak.report``), 0 otherwise.

``--server HOST:PORT`` soaks a running orchestrator instead (nothing is
killed: the soak can only restart what it started); ``--state FILE``, the
file ``specdec up --state`` writes, names its backends (open sessions) and
pids (memory).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from specdec.cli.generate import add_model_flags
from specdec.cli.options import medusa_drafter_argv, model_dir
from specdec.procs import STARTUP_TIMEOUT_S, feature_layer_flags
from specdec.request.errors import UsageError
from specdec.soak.run import DEFAULT_KILLS, Backend, Soak, SoakConfig, SoakError
from specdec.soak.stack import ROLES, Models, SoakStack, StackError
from orchestrator.plane import DIRECT, PLANES


def _kills(text: str) -> tuple[str, ...]:
    roles = tuple(r.strip() for r in text.split(",") if r.strip())
    unknown = [r for r in roles if r not in ROLES]
    if unknown:
        raise UsageError(f"--kills: unknown role {unknown[0]!r} (roles: {', '.join(ROLES)})")
    return roles


def add_parser(sub) -> None:
    p = sub.add_parser("soak", help="long disturbed load on the stack: report losses and leaks")
    w = p.add_argument_group("the stack (default: started here, like `specdec up`)")
    w.add_argument("--server", metavar="HOST:PORT", help="soak this running orchestrator instead (no kills)")
    w.add_argument("--state", metavar="FILE", help="with --server: `specdec up --state` file (backends, pids)")
    w.add_argument("--verifiers", type=int, default=1, metavar="M")
    w.add_argument("--drafters", type=int, default=1, metavar="N")
    w.add_argument("--plane", choices=PLANES, default=DIRECT,
                   help="the orchestrator's data plane (default direct: each verifier calls its paired "
                        "drafter itself; relay: through the orchestrator)")
    add_model_flags(p)
    p.add_argument("--clients", type=int, default=16, metavar="C", help="concurrent clients (default 16)")
    p.add_argument("--duration", type=float, default=600.0, metavar="S", help="seconds of load (default 600)")
    p.add_argument("--kills", default=None, metavar="ROLES",
                   help="processes to SIGKILL and restart, in order, evenly spread over the load "
                        "(comma-separated roles: verifier, drafter, orchestrator; '' for none; "
                        "default: each twice)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens per request (default 48)")
    p.add_argument("--settle", type=float, default=5.0, metavar="S",
                   help="after the load, seconds before counting open sessions (default 5)")
    p.add_argument("--max-rss-growth", type=float, default=0.10, metavar="FRACTION",
                   help="fail when a process that was not killed grew its RSS by more (default 0.10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the clients' request mix")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON here ('-': stdout)")
    p.add_argument("--startup-timeout", type=float, default=STARTUP_TIMEOUT_S,
                   help="seconds for the stack to be ready (a first start builds the compiled graphs)")
    p.add_argument("--log-level", default="WARNING", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="log level of the services (their logs go to files in the soak's work directory)")
    p.set_defaults(run=run_soak)


def _models(args) -> Models:
    target = model_dir(args.target, "target", "target model", "--target")
    verifier = ("--target", target, "--dtype", args.dtype, "--weights", args.weights, "--compile", args.compile)
    if args.ngram:
        drafter = ("--ngram", "--target", target)
    elif args.medusa is not None or getattr(args, "hydra", None) is not None:
        drafter = tuple(medusa_drafter_argv(args, target))
    elif args.draft_lm:
        drafter = ("--draft-lm", model_dir(args.draft_lm, "draft-lm", "draft LM", "--draft-lm"), "--dtype", args.dtype,
                   "--weights", args.weights, "--compile", args.compile)
    else:
        eagle = model_dir(args.eagle, "eagle", "EAGLE head", "--eagle")
        drafter = ("--eagle", eagle, "--target", target, "--dtype", args.dtype, "--compile", args.compile)
        verifier += tuple(feature_layer_flags(eagle, args.compile))
    cache = ("--prefix-cache-tokens", str(args.prefix_cache_tokens)) + (
        ("--prefix-cache-exact",) if args.prefix_cache_exact else ())
    return Models(verifier + cache, drafter + cache, target)


def _backends_from_state(path: str | None) -> tuple[list[Backend], dict[str, int]]:
    if path is None:
        return [], {}
    try:
        state = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"--state {path}: {exc}") from None
    backends = [Backend(f"{role}-{i + 1}", role, entry["addr"], entry.get("pid"))
                for role, key in (("verifier", "verifiers"), ("drafter", "drafters"))
                for i, entry in enumerate(state.get(key, []))]
    return backends, {b.name: b.pid for b in backends if b.pid}


def _config(args) -> SoakConfig:
    try:
        kills = _kills(args.kills) if args.kills is not None else () if args.server else DEFAULT_KILLS
        return SoakConfig(clients=args.clients, duration_s=args.duration, kills=kills,
                          max_new_tokens=args.max_new_tokens, settle_s=args.settle,
                          max_rss_growth=args.max_rss_growth, seed=args.seed,
                          restart_timeout_s=args.startup_timeout)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _progress(line: str) -> None:
    print(f"specdec soak: {line}", file=sys.stderr, flush=True)


def run_soak(args) -> int:
    config = _config(args)
    if args.server:
        if config.kills:
            raise UsageError("--kills needs a stack the soak starts itself (leave out --server)")
        backends, pids = _backends_from_state(args.state)
        try:
            report = asyncio.run(Soak(config, args.server, backends, pids=pids).run(_progress))
        except SoakError as exc:
            raise UsageError(str(exc)) from None
    else:
        if args.state:
            raise UsageError("--state goes with --server")
        if args.verifiers < 1 or args.drafters < 0:
            raise UsageError(f"--verifiers must be >= 1 and --drafters >= 0, got {args.verifiers} and {args.drafters}")
        report = _soak_own_stack(args, config)
    print(report.text(), flush=True)
    if args.json == "-":
        print(report.dumps())
    elif args.json:
        Path(args.json).write_text(report.dumps() + "\n")
    return 1 if report.failures() else 0


def _soak_own_stack(args, config: SoakConfig):
    """Start the stack, soak it, stop it; the services' logs are kept when one of
    them would not start or died on its own."""
    models = _models(args)
    workdir = Path(tempfile.mkdtemp(prefix="specdec-soak-"))
    stack = SoakStack(models, args.verifiers, args.drafters, workdir, args.log_level,
                      orchestrator_argv=("--plane", args.plane))

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt           # unwind through the finally below: no orphaned servers

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    report = None
    try:
        _progress(f"starting {args.verifiers} verifier(s), {args.drafters} drafter(s) and an orchestrator")
        stack.start(args.startup_timeout)
        backends = [Backend(p.name, p.role, p.address) for p in stack.backends]
        report = asyncio.run(Soak(config, stack.orchestrator.address, backends, stack).run(_progress))
        return report
    except (StackError, SoakError) as exc:
        raise UsageError(str(exc)) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
        stack.stop()
        if report is not None and not report.died:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            _progress(f"the services' logs are in {workdir}")
