"""``specdec up``: the whole stack on one machine.

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
import json
import signal
import sys
import time
from pathlib import Path

from specdec.cli.http_flags import add_up_http_flag, chat_template_from, up_http_port
from specdec.cli.options import add_model_flags, add_tree_sizing_flag, env, medusa_drafter_argv, model_dir
from specdec.cli.stack import ORCHESTRATOR_PORTS
from specdec.procs import (STARTUP_TIMEOUT_S, Child, ChildDied, check_alive, feature_layer_flags, ignore_stop_signals,
                           solo_env, solo_threads, spawn, stop, threads_per_process, wait_listening, wait_serving)
from specdec.request import knobs
from specdec.request.errors import UsageError
from specdec.request.params import LOOKAHEAD, REQUEST_METHODS, VANILLA

DEMO_PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
DEMO_QUESTION = "What are three good habits for writing readable Python code?"   # a chat model's demo


def add_parser(sub) -> None:
    u = sub.add_parser("up", help="verifier + drafter + orchestrator on this machine, one command")
    add_up_flags(u)
    u.set_defaults(run=run_up)


def add_up_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=ORCHESTRATOR_PORTS[0], help="orchestrator port (0 = any free port)")
    p.add_argument("--metrics-port", default="0", help="orchestrator metrics port (0 = any free port, 'off')")
    add_up_http_flag(p)
    add_model_flags(p)
    p.add_argument("--method", default=knobs.DEFAULT_METHOD, choices=REQUEST_METHODS,
                   help="default tree method (vanilla: no drafter process; lookahead: lookahead decoding on the "
                        "verifier, no drafter process, W,N,G from --lookahead-wng)")
    add_tree_sizing_flag(p)
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
    p.add_argument("--startup-timeout", type=float, default=STARTUP_TIMEOUT_S,
                   help="seconds to wait for all to be ready (a first start builds the compiled graphs)")
    p.add_argument("--log-level", default="WARNING", type=str.upper,
                   choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log level of the services")


def drafts_ahead() -> bool:
    """Whether the orchestrator ``up`` starts will draft ahead (SPECDEC_LOOKAHEAD,
    which it inherits): its drafter then computes during verifies, so the
    verifier gets no solo threads."""
    try:
        return int(env("SPECDEC_LOOKAHEAD", knobs.DEFAULT_LOOKAHEAD)) != 0
    except ValueError:
        return True                      # the orchestrator reports the bad value


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
        check_alive([orchestrator])
        for child in backends:
            code = child.proc.poll()
            if code is None or child.name in reported:
                continue
            reported.add(child.name)
            left = sum(1 for c in backends if role(c) == role(child) and c.proc.poll() is None)
            print(f"specdec up: the {child.name} (pid {child.proc.pid}) exited with status {code}; "
                  f"{left} {role(child)}(s) left, going on", file=sys.stderr, flush=True)
        time.sleep(0.2)


def _model_argv(args) -> tuple[list[str], list[str] | None, str]:
    """Flags for the verifier, for the drafter (None: no drafter) and the tokenizer directory."""
    target = model_dir(args.target, "target", "target model", "--target")
    verifier = ["--target", target, "--dtype", args.dtype, "--weights", args.weights, "--compile", args.compile]
    if getattr(args, "tree_sizing", None):       # `up`'s flag; `soak` leaves it to SPECDEC_TREE_SIZING
        verifier += ["--tree-sizing", args.tree_sizing]
    verifier += ["--lookahead-wng", str(args.lookahead_wng)]
    if args.method in (VANILLA, LOOKAHEAD):         # lookahead: the verifier drafts, no drafter process
        drafter = None
    elif args.ngram:
        drafter = ["--ngram", "--target", target]
    elif args.medusa is not None or getattr(args, "hydra", None) is not None:
        drafter = medusa_drafter_argv(args, target)
    elif args.draft_lm:
        drafter = ["--draft-lm", model_dir(args.draft_lm, "draft-lm", "draft LM", "--draft-lm"), "--dtype", args.dtype,
                   "--weights", args.weights, "--compile", args.compile]
    else:
        eagle = model_dir(args.eagle, "eagle", "EAGLE head", "--eagle")
        # an EAGLE head drafts in float32 whatever the target's dtype, as in process: on CPU its float32
        # products take the faster layout, and the draft's precision never touches what is committed
        # (docs/models.md, "Precision"); at --weights w8a8 an EAGLE-3 head's layer and draft head are w8a8 too
        drafter = ["--eagle", eagle, "--target", target, "--weights", args.weights, "--compile", args.compile]
        verifier += feature_layer_flags(eagle, args.compile)
    verifier += ["--tokenizer", target]              # structured output: the grammar's tokens
    if drafter is not None:
        drafter += ["--tokenizer", target]
    tokens = getattr(args, "prefix_cache_tokens", None)
    if tokens is not None:                       # both services keep prefixes (an n-gram drafter has none)
        cache = ["--prefix-cache-tokens", str(tokens)] + (["--prefix-cache-exact"] if args.prefix_cache_exact else [])
        verifier += cache
        if drafter is not None:
            drafter += cache
    return verifier, drafter, target


def run_up(args) -> int:
    if args.demo_max_new_tokens < 1:
        raise UsageError(f"--demo-max-new-tokens must be >= 1, got {args.demo_max_new_tokens}")
    if args.verifiers < 1:
        raise UsageError(f"--verifiers must be >= 1, got {args.verifiers}")
    if args.drafters < 0:
        raise UsageError(f"--drafters must be >= 0, got {args.drafters}")
    verifier_argv, drafter_argv, tokenizer = _model_argv(args)
    chat = chat_template_from(args, tokenizer) is not None   # a template that does not load: one line, before any process
    if args.drafters == 0:
        drafter_argv = None
    internal = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--drain-s", "2",
                "--log-level", args.log_level]

    def on_sigterm(signum, frame):
        ignore_stop_signals()               # stopping from here on: a repeated signal must not cut it short
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
        solo = solo_threads(threads, torch_processes) if args.verifiers == 1 and not drafts_ahead() else 0
        solo_argv, spawn_env = (["--solo-threads", str(solo)], solo_env()) if solo else ([], None)
        verifiers = [spawn(name, ["verifier", "serve", *verifier_argv, *solo_argv, *internal], threads=threads,
                           env_defaults=spawn_env)
                     for name in _names("verifier", args.verifiers)]
        drafters = [] if drafter_argv is None else [
            spawn(name, ["drafter", "serve", *drafter_argv, *internal], threads=threads)
            for name in _names("drafter", args.drafters)]
        children += verifiers + drafters
        wait_listening(children, deadline)
        orch_argv = ["orchestrator", "serve", "--verifier", ",".join(c.address for c in verifiers),
                     "--tokenizer", tokenizer, "--host", "127.0.0.1", "--port", str(args.port),
                     "--metrics-port", str(args.metrics_port), "--drain-s", "2", "--log-level", args.log_level]
        if args.chat_template:
            orch_argv += ["--chat-template", str(Path(args.chat_template).resolve())]
        http_port = up_http_port(args)
        if http_port is not None:
            orch_argv += ["--http-port", str(http_port)]
        if drafters:
            orch_argv += ["--drafter", ",".join(c.address for c in drafters), "--method", args.method]
        elif args.method == LOOKAHEAD:
            orch_argv += ["--method", LOOKAHEAD]
        orchestrator = spawn("orchestrator", orch_argv, module="specdec.cli.stack")
        children.append(orchestrator)
        wait_listening(children, deadline)
        wait_serving(children, deadline)
        if args.state:
            _write_state(args.state, orchestrator, verifiers, drafters)
        where = ", ".join(f"{c.name} {c.address}" for c in verifiers + drafters)
        print(f"specdec up: orchestrator on {orchestrator.address} ({where})", flush=True)
        if orchestrator.http_port is not None:
            print(f"specdec up: OpenAI-compatible API on http://127.0.0.1:{orchestrator.http_port}/v1", flush=True)
        if args.demo_generation:
            _demo(orchestrator.address, args.demo_max_new_tokens, chat)
            if args.exit_after_demo:
                return 0
        _watch(orchestrator, verifiers + drafters)
    except ChildDied as exc:
        print(f"specdec up: {exc}; stopping the others", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        ignore_stop_signals()
        print("specdec up: stopping", file=sys.stderr, flush=True)
        return 0
    finally:
        stop(children)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if args.state:
            Path(args.state).unlink(missing_ok=True)
    return 0


def _demo(address: str, max_new_tokens: int, chat: bool) -> None:
    """One generation streamed to stdout: a question in the chat template where
    the target has one, else the start of a function for the code demo."""
    from specdec.client import SpecdecClient, SpecdecClientError     # grpc: only for the demo

    with SpecdecClient(address, timeout=120.0) as client:
        try:
            if chat:
                stream = client.generate(messages=[{"role": "user", "content": DEMO_QUESTION}],
                                         max_new_tokens=max_new_tokens)
                sys.stdout.write(f"user: {DEMO_QUESTION}\nassistant: ")
            else:
                stream = client.generate(DEMO_PROMPT, max_new_tokens=max_new_tokens)
                sys.stdout.write(DEMO_PROMPT)
            for chunk in stream:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        except SpecdecClientError as exc:
            raise UsageError(f"demo generation failed: {exc}") from None
    s = stream.stats
    print(f"\n[{s.completion_tokens} tokens in {s.cycles} cycles, tau {s.tau:.2f}, {s.tokens_per_s:.1f} tok/s, "
          f"ttft {s.ttft_s * 1e3:.0f} ms; time split: draft {s.draft_s:.3f}s, verify {s.verify_s:.3f}s, "
          f"network {s.network_s:.3f}s, other {s.other_s:.3f}s"
          + (f"; trees drafted ahead: {s.ahead_hits} of {s.cycles}" if s.ahead_hits else "")
          + f"; finish: {s.finish_reason}]", flush=True)
