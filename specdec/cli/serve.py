"""``specdec verifier serve`` and ``specdec drafter serve``.

Flags, with environment equivalents where a deployment sets them:
  --host (SPECDEC_HOST), --port (SPECDEC_PORT), --metrics-port
  (SPECDEC_METRICS_PORT; "off" disables), --auth-token (SPECDEC_AUTH_TOKEN),
  --tls-cert / --tls-key / --tls-client-ca (SPECDEC_TLS_CERT, SPECDEC_TLS_KEY,
  SPECDEC_TLS_CLIENT_CA), --drain-s (SPECDEC_DRAIN_S), --log-level
  (SPECDEC_LOG_LEVEL), --compile (SPECDEC_COMPILE). A flag wins over its variable.

On start the server prints one JSON line on stdout,
``{"event": "listening", "port": N, "metrics_port": M}`` (the ports chosen
when 0 was asked), loads and warms up its model, then reports ready on the
health service and writes the same line to ``--ready-file`` if given. Logs are
JSON lines on stderr. ``add_server_flags`` / ``server_config_from`` are shared
with ``specdec orchestrator serve``.
"""

from __future__ import annotations

import argparse
import asyncio

from specdec.cli.options import (add_compile_flag, add_lookahead_flag, add_medusa_flags, add_prefix_cache_flag,
                                 add_tree_sizing_flag, add_weights_flag, env, hydra_dir, medusa_choices, medusa_dir,
                                 model_dir)
from specdec.model.loading import ATTN_IMPLEMENTATIONS
from specdec.request import knobs
from specdec.request.errors import UsageError
from specdec.request.params import METHODS, PROPOSALS, TreeParams
from specdec.serving.server import ClientTls, ServerConfig
from specdec.serving.sessions import DEFAULT_LEASE_S

VERIFIER_PORTS = (50052, 9452)        # (gRPC, metrics) defaults
DRAFTER_PORTS = (50053, 9453)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {value}")
    return value


def _metrics_port(text: str) -> int | None:
    return None if str(text).lower() in ("off", "none", "-1") else _port(text)


def add_server_flags(p: argparse.ArgumentParser, default_port: int, default_metrics_port: int) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default=env("SPECDEC_HOST", "127.0.0.1"),
                   help="address to listen on (env SPECDEC_HOST; default 127.0.0.1)")
    g.add_argument("--port", type=_port, default=env("SPECDEC_PORT", default_port),
                   help=f"gRPC port, 0 = any free port (env SPECDEC_PORT; default {default_port})")
    g.add_argument("--metrics-port", type=_metrics_port, default=env("SPECDEC_METRICS_PORT", default_metrics_port),
                   help=f"Prometheus port, 0 = any free port, 'off' = none (env SPECDEC_METRICS_PORT; "
                        f"default {default_metrics_port})")
    g.add_argument("--auth-token", default=env("SPECDEC_AUTH_TOKEN"),
                   help="require 'authorization: Bearer TOKEN' on every RPC but health checks "
                        "(env SPECDEC_AUTH_TOKEN, preferred: flags show in process lists)")
    g.add_argument("--tls-cert", default=env("SPECDEC_TLS_CERT"), help="server certificate, PEM (env SPECDEC_TLS_CERT)")
    g.add_argument("--tls-key", default=env("SPECDEC_TLS_KEY"), help="server private key, PEM (env SPECDEC_TLS_KEY)")
    g.add_argument("--tls-client-ca", default=env("SPECDEC_TLS_CLIENT_CA"),
                   help="CA of client certificates: require mutual TLS (env SPECDEC_TLS_CLIENT_CA)")
    g.add_argument("--drain-s", type=float, default=env("SPECDEC_DRAIN_S", 20.0),
                   help="on SIGTERM, time given to open sessions to finish (env SPECDEC_DRAIN_S; default 20)")
    g.add_argument("--log-level", default=env("SPECDEC_LOG_LEVEL", "INFO"),
                   choices=("DEBUG", "INFO", "WARNING", "ERROR"), type=str.upper)
    g.add_argument("--ready-file", help="write the listening JSON line to this file once ready")


def server_config_from(args) -> ServerConfig:
    return ServerConfig(host=args.host, port=args.port, metrics_port=args.metrics_port, tls_cert=args.tls_cert,
                        tls_key=args.tls_key, tls_client_ca=args.tls_client_ca, auth_token=args.auth_token,
                        drain_s=args.drain_s)


def _add_session_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sessions")
    g.add_argument("--max-sessions", type=int, default=64, help="open sessions at most (RESOURCE_EXHAUSTED past it)")
    g.add_argument("--session-ttl", type=float, default=600.0, help="evict a session idle this many seconds")
    g.add_argument("--lease-s", type=float, default=DEFAULT_LEASE_S,
                   help="evict an orchestrator's session this many seconds after its lease was last renewed "
                        f"(the orchestrator renews every second; default {DEFAULT_LEASE_S:g})")


    g.add_argument("--solo-threads", type=int, default=env("SPECDEC_SOLO_THREADS", 0),
                   help="torch threads for a model call while at most one session is open; otherwise "
                        "OMP_NUM_THREADS / torch's default (0 = always that; for a drafter and verifier "
                        "sharing cores, which alternate while one session runs, unless the orchestrator "
                        "drafts ahead; env SPECDEC_SOLO_THREADS)")
    add_prefix_cache_flag(g)


def _check_sessions(args) -> None:
    if args.max_sessions < 1:
        raise UsageError(f"--max-sessions must be >= 1, got {args.max_sessions}")
    if not args.session_ttl > 0:
        raise UsageError(f"--session-ttl must be > 0, got {args.session_ttl}")
    if not args.lease_s > 0:
        raise UsageError(f"--lease-s must be > 0, got {args.lease_s}")
    if args.solo_threads < 0:
        raise UsageError(f"--solo-threads must be >= 0, got {args.solo_threads}")


def add_parsers(sub) -> None:
    v = sub.add_parser("verifier", help="the verifier service (hosts the target model)")
    p = v.add_subparsers(dest="verifier_command", required=True).add_parser(
        "serve", help="serve VerifierService over gRPC")
    p.add_argument("--target", help="target model: a directory or a GGUF file (default: the bundled demo target)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    add_weights_flag(p, "the target's")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    p.add_argument("--attn-implementation", default="auto", choices=ATTN_IMPLEMENTATIONS,
                   help="auto (default): specdec's SDPA where the model allows, else its best; or force sdpa / eager")
    add_compile_flag(p)
    p.add_argument("--compile-feature-layers", action="store_true",
                   help="with --compile: also compile the forwards of sessions that ask for feature layers "
                        "(EAGLE-3 drafters read three layers' residual streams); without it they verify eagerly. "
                        "specdec up, soak and bench set it for an EAGLE-3 head")
    p.add_argument("--feature-dtype", default="float32", choices=("float32", "float16"),
                   help="dtype of the features sent to EAGLE drafters")
    p.add_argument("--compile-tree-tokens", type=int,
                   default=env("SPECDEC_COMPILE_TREE_TOKENS", knobs.DEFAULT_TOTAL_TOKENS),
                   help="with --compile: build the graphs of trees up to this many nodes at start-up (a cold "
                        "cache: minutes per width past 16); a wider tree, whose graph was not built, verifies "
                        f"eagerly rather than wait for a build (at most {knobs.MAX_COMPILED_TREE}; default "
                        f"{knobs.DEFAULT_TOTAL_TOKENS}, the default tree; env SPECDEC_COMPILE_TREE_TOKENS)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks: shard the target over this many processes (gloo on CPU, "
                        "NCCL on GPUs: rank r uses cuda:r); must divide the attention and key/value heads")
    p.add_argument("--kv-budget-bytes", type=int, default=None,
                   help="refuse new sessions (RESOURCE_EXHAUSTED) before their worst-case KV "
                        "(prompt + max_new_tokens + one tree) would exceed this many bytes (all ranks)")
    p.add_argument("--tokenizer", help="tokenizer directory for structured output (a request's constraint); "
                                       "default: the --target directory when it holds one, else constrained "
                                       "requests are refused")
    p.add_argument("--batch-window-ms", type=float, default=2.0,
                   help="collect concurrent sessions' verifies for up to this long and run them as one "
                        "forward (0 = off; a lone session never waits)")
    p.add_argument("--max-batch", type=int, default=16, help="sessions per batched verify at most")
    add_tree_sizing_flag(p)
    add_lookahead_flag(p)
    _add_session_flags(p)
    g = p.add_argument_group("the direct plane (an orchestrator with --plane direct pairs this verifier with "
                             "drafters it then calls itself)")
    g.add_argument("--peer-ca", default=env("SPECDEC_PEER_CA"), help="CA of the drafters' certificates (TLS; "
                                                                     "env SPECDEC_PEER_CA)")
    g.add_argument("--peer-cert", default=env("SPECDEC_PEER_CERT"), help="client certificate for the drafters "
                                                                         "(mutual TLS; env SPECDEC_PEER_CERT)")
    g.add_argument("--peer-key", default=env("SPECDEC_PEER_KEY"), help="its key (env SPECDEC_PEER_KEY)")
    g.add_argument("--peer-token", default=env("SPECDEC_PEER_TOKEN"),
                   help="bearer token for the drafters (env SPECDEC_PEER_TOKEN)")
    add_server_flags(p, *VERIFIER_PORTS)
    p.set_defaults(run=run_verifier)

    d = sub.add_parser("drafter", help="the drafter service (EAGLE head, small LM or n-gram)")
    p = d.add_subparsers(dest="drafter_command", required=True).add_parser(
        "serve", help="serve DrafterService over gRPC (default: the bundled demo EAGLE head)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--eagle", help="EAGLE head directory, EAGLE-1/2 or EAGLE-3 (needs --target for embeddings / lm_head)")
    kind.add_argument("--draft-lm", help="small causal LM (directory or GGUF file) sharing the target's tokenizer")
    kind.add_argument("--ngram", action="store_true", help="prompt-lookup drafter (no model)")
    add_medusa_flags(kind, p)
    p.add_argument("--target", help="target model directory (EAGLE, Hydra: embeddings and lm_head; Medusa: its hidden size "
                                    "and vocabulary; n-gram: vocab size)")
    p.add_argument("--vocab-size", type=int, help="n-gram: vocabulary size (instead of --target)")
    p.add_argument("--tokenizer", help="tokenizer directory: drafts of constrained requests follow the grammar "
                                       "(default: the --target or --draft-lm directory when it holds one, else "
                                       "such drafts are unmasked, still exact)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    add_weights_flag(p, "a draft LM's (at w8a8 also an EAGLE-3 head's)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    add_compile_flag(p, "EAGLE heads' draft levels over a fixed-shape KV buffer (drafter.compiled.head_levels) "
                        "and a draft LM's steps (specdec.compile.forwards)")
    t = p.add_argument_group("draft tree (a request's 0 / unset knobs take these; larger ones are clamped)")
    t.add_argument("--method", default=knobs.DEFAULT_METHOD, choices=METHODS)
    t.add_argument("--total-tokens", type=int, default=knobs.DEFAULT_TOTAL_TOKENS)
    t.add_argument("--depth", type=int, default=knobs.DEFAULT_DEPTH)
    t.add_argument("--expand-k", type=int, default=knobs.DEFAULT_EXPAND_K)
    t.add_argument("--proposals", default=knobs.DEFAULT_PROPOSALS, choices=PROPOSALS,
                   help="sessions at T > 0: sampled (drawn from the draft distribution), top, or auto (sampled)")
    t.add_argument("--max-total-tokens", type=int, default=64)
    t.add_argument("--max-depth", type=int, default=8)
    t.add_argument("--max-expand-k", type=int, default=10)
    p.add_argument("--batch-window-ms", type=float, default=env("SPECDEC_BATCH_WINDOW_MS", 2.0),
                   help="collect concurrent sessions' drafts for up to this long and expand their trees "
                        "together, one forward per level (0 = off; a lone session never waits; "
                        "env SPECDEC_BATCH_WINDOW_MS)")
    p.add_argument("--max-batch", type=int, default=env("SPECDEC_MAX_BATCH", 16),
                   help="sessions per batched draft at most (env SPECDEC_MAX_BATCH)")
    _add_session_flags(p)
    add_server_flags(p, *DRAFTER_PORTS)
    p.set_defaults(run=run_drafter)


def _serve(cfg: ServerConfig, servicer, name: str, build, args) -> int:
    from specdec.serving.server import configure_logging, run_server

    configure_logging(name, args.log_level)
    try:
        asyncio.run(run_server(cfg, [servicer.registration()], name, load=lambda: servicer.load(build),
                               ready_file=args.ready_file))
    except (OSError, RuntimeError) as exc:     # port taken, unreadable weights...: logged in full above
        raise UsageError(f"{name} failed: {exc}") from None
    return 0


def run_verifier(args) -> int:
    from specdec.model.loading import ModelSpec

    _check_sessions(args)
    cfg = server_config_from(args)
    spec = ModelSpec(path=model_dir(args.target, "target", "target model", "--target"), dtype=args.dtype,
                     device=args.device, attn_implementation=args.attn_implementation, compile=args.compile,
                     compile_layers=args.compile_feature_layers, weights=args.weights)
    from specdec.model.gguf_import import source_of
    from verifier.service import VerifierService, VerifierServiceConfig

    if args.tp < 1:
        raise UsageError(f"--tp must be >= 1, got {args.tp}")
    if not 1 <= args.compile_tree_tokens <= knobs.MAX_COMPILED_TREE:
        raise UsageError(f"--compile-tree-tokens must be in [1, {knobs.MAX_COMPILED_TREE}], "
                         f"got {args.compile_tree_tokens}")
    if args.kv_budget_bytes is not None and args.kv_budget_bytes < 1:
        raise UsageError(f"--kv-budget-bytes must be >= 1, got {args.kv_budget_bytes}")
    if args.batch_window_ms < 0 or args.max_batch < 1:
        raise UsageError("--batch-window-ms must be >= 0 and --max-batch >= 1")
    if args.tp > 1:
        from verifier.tp import check_tp_degree

        check_tp_degree(spec.path, args.tp)
    if args.tp > 1 and args.solo_threads:
        raise UsageError("--solo-threads needs --tp 1 (tensor-parallel ranks keep their own threads)")
    peer_tls = None
    if args.peer_ca or args.peer_cert or args.peer_key:
        peer_tls = ClientTls(ca=args.peer_ca, cert=args.peer_cert, key=args.peer_key)
    servicer = VerifierService(VerifierServiceConfig(feature_dtype=args.feature_dtype,
                                                     batch_window_ms=args.batch_window_ms,
                                                     max_batch=args.max_batch, solo_threads=args.solo_threads,
                                                     lease_s=args.lease_s, model_name=source_of(spec.path) or "",
                                                     peer_tls=peer_tls, peer_token=args.peer_token))

    def build():
        from verifier.engine import TargetModel, VerifierEngine

        if args.tp > 1:
            import atexit

            from verifier.tp import start_ranks

            verifier = start_ranks(args.tp, spec, args.max_sessions, args.session_ttl, args.kv_budget_bytes,
                                   tree_sizing=args.tree_sizing, prefix_cache_tokens=args.prefix_cache_tokens,
                                   prefix_cache_exact=args.prefix_cache_exact, lookahead=args.lookahead_wng)
            atexit.register(verifier.shutdown)
            return verifier
        from specdec.model.loading import default_grammar_tokenizer

        target = TargetModel(spec)
        target.unbuilt_eager(args.compile_tree_tokens)      # no request waits for a graph to be built
        return VerifierEngine(target, max_sessions=args.max_sessions, ttl_s=args.session_ttl,
                              kv_budget_bytes=args.kv_budget_bytes, tree_sizing=args.tree_sizing,
                              grammar_tokenizer=default_grammar_tokenizer(args.tokenizer, spec.path),
                              prefix_cache_tokens=args.prefix_cache_tokens, prefix_cache_exact=args.prefix_cache_exact,
                              lookahead=args.lookahead_wng)

    return _serve(cfg, servicer, "verifier", build, args)


def _drafter_builder(args, default: TreeParams):
    """Validate the drafter flags now (one-line errors), build the drafter later
    (a compiled EAGLE drafter drafts ``default``, its default tree, whole:
    ``drafter.compiled.whole_draft``)."""
    from specdec.model.loading import ModelSpec, read_config, torch_dtype

    sessions = dict(max_sessions=args.max_sessions, ttl_s=args.session_ttl)
    if args.ngram:
        if args.vocab_size is not None:
            if args.vocab_size < 1:
                raise UsageError(f"--vocab-size must be >= 1, got {args.vocab_size}")
            vocab = args.vocab_size
        else:
            vocab = int(read_config(model_dir(args.target, "target", "target model", "--target"))["vocab_size"])

        def build():
            from drafter.ngram import NgramDrafter

            return NgramDrafter(vocab, **sessions)
        return build
    if args.medusa is not None:
        from drafter.medusa import load_medusa_drafter

        # loaded now: heads that do not fit the target stop the service before it starts
        drafter = load_medusa_drafter(medusa_dir(args.medusa), model_dir(args.target, "target", "target model",
                                                                         "--target"),
                                      dtype=torch_dtype(args.dtype), device=args.device,
                                      static_shape=medusa_choices(args.medusa_choices), **sessions)
        return lambda: drafter
    if args.hydra is not None:
        from drafter.hydra import load_hydra_drafter

        # loaded now: heads that do not fit the target stop the service before it starts
        drafter = load_hydra_drafter(hydra_dir(args.hydra), model_dir(args.target, "target", "target model",
                                                                      "--target"),
                                     dtype=torch_dtype(args.dtype), device=args.device,
                                     static_shape=medusa_choices(args.medusa_choices), **sessions)
        return lambda: drafter
    if args.medusa_choices:
        raise UsageError("--medusa-choices needs --medusa or --hydra")
    if args.draft_lm:
        spec = ModelSpec(path=model_dir(args.draft_lm, "draft-lm", "draft LM", "--draft-lm"), dtype=args.dtype,
                         device=args.device, compile=args.compile, weights=args.weights)

        def build():
            from drafter.draft_lm import DraftLmDrafter

            drafter = DraftLmDrafter(spec, **sessions)
            drafter.use_prefix_cache(args.prefix_cache_tokens, args.prefix_cache_exact)
            return drafter
        return build
    head = model_dir(args.eagle, "eagle", "EAGLE head", "--eagle")
    target = model_dir(args.target, "target", "target model", "--target")
    dtype = torch_dtype(args.dtype)

    def build():
        from drafter.compiled.whole_draft import use_budget
        from drafter.eagle.eagle3 import load_eagle_drafter

        drafter = load_eagle_drafter(head, target, dtype=dtype, device=args.device, compile=args.compile,
                                     weights=args.weights, **sessions)
        use_budget(drafter, default)
        drafter.use_prefix_cache(args.prefix_cache_tokens, args.prefix_cache_exact)
        return drafter
    return build


def _with_grammar(build, args):
    """``build`` whose drafter gets the grammar tokenizer (``--tokenizer`` or the model directory's)."""
    def build_masked():
        from specdec.model.loading import default_grammar_tokenizer

        drafter = build()
        drafter.grammar_tokenizer = default_grammar_tokenizer(args.tokenizer, args.target, args.draft_lm)
        return drafter
    return build_masked


def run_drafter(args) -> int:
    _check_sessions(args)
    cfg = server_config_from(args)
    default = TreeParams(method=args.method, total_tokens=args.total_tokens, depth=args.depth,
                         expand_k=args.expand_k, proposals=args.proposals)
    limits = TreeParams(total_tokens=args.max_total_tokens, depth=args.max_depth, expand_k=args.max_expand_k)
    if not args.batch_window_ms >= 0 or args.max_batch < 1:
        raise UsageError("--batch-window-ms must be >= 0 and --max-batch >= 1")
    build = _with_grammar(_drafter_builder(args, default), args)
    from drafter.service import DrafterService, DrafterServiceConfig

    servicer = DrafterService(DrafterServiceConfig(default_tree=default, limits=limits,
                                                   batch_window_ms=args.batch_window_ms, max_batch=args.max_batch,
                                                   solo_threads=args.solo_threads, lease_s=args.lease_s))
    return _serve(cfg, servicer, "drafter", build, args)
