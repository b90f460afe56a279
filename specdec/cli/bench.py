"""``specdec bench``: every method side by side on one machine, paper-style.

    specdec bench --prompts specdec/bench/prompts.jsonl --json out.json --report out/
    specdec bench sweep --json sweep.json --report out/      # tree budget sweep
    specdec bench --concurrency 1,2,4,8 --json conc.json --report out/   # C requests in flight
    specdec bench prefix --json prefix.json     # a shared 1,000-token system prompt: TTFT cold vs warm

Models default to the bundled demo family. See ``specdec.bench`` for the
measurement protocol and the JSON schema.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

from specdec.cli.options import (PREFIX_CACHE_TOKENS, add_compile_flag, add_lookahead_flag, add_tree_flags,
                                 add_tree_sizing_flag, add_weights_flag, hydra_dir, medusa_dir, model_dir,
                                 prefix_cache_tokens, read_prompts, resolved_min_tau)
from specdec.procs import STARTUP_TIMEOUT_S, pinned_cores
from specdec.request.errors import UsageError

BUNDLED_PROMPTS = Path(__file__).resolve().parent.parent / "bench" / "prompts.jsonl"
CONCURRENCY_METHODS = ("vanilla", "eagle2")       # --methods default with --concurrency
CYCLE_METHODS = ("vanilla", "eagle2", "eagle3")   # --methods default with `bench profile --cycle`


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def add_parser(sub) -> None:
    from specdec.bench.concurrency import DEFAULT_REQUESTS_PER_LEVEL
    from specdec.bench.runner import ALL_METHODS, SWEEP_DEPTHS, SWEEP_TOTALS

    p = sub.add_parser("bench", help="benchmark methods side by side (speedup, tau, acceptance, plots)",
                       description="Run every method on the same prompts, interleaved per prompt, and report "
                                   "tokens/s, speedups, tau (bonus token included) and acceptance per position. "
                                   "`specdec bench sweep` measures eagle2 over tree sizes and depths instead.")
    p.add_argument("mode", nargs="?", choices=("sweep", "profile", "prefix"),
                   help="sweep: tree budget sweep of eagle2; profile: where a step's time goes (eager, compiled); "
                        "prefix: requests sharing a system prompt, time to first token with the prefix cache cold, "
                        "warm and off (specdec.bench.prefix)")
    g = p.add_argument_group("models (default: the bundled demo family)")
    g.add_argument("--target", help="target model directory (HF causal LM with its tokenizer)")
    g.add_argument("--eagle", help="EAGLE-1/2 head directory (chain, static, eagle2, no-value, no-rerank)")
    g.add_argument("--eagle3", help="EAGLE-3 head directory (eagle3; default: the bundled demo's)")
    g.add_argument("--medusa", help="Medusa heads directory (medusa, medusa-static; default: the bundled demo's)")
    g.add_argument("--hydra", help="Hydra heads directory (hydra, hydra-static; default: the bundled demo's)")
    g.add_argument("--draft-lm", help="small causal LM directory (hf-assisted, sps)")
    add_lookahead_flag(g)
    g.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    add_weights_flag(g)
    g.add_argument("--device", default="cpu", help="torch device of every model, e.g. cpu (default) or cuda:0")
    add_compile_flag(g)
    p.add_argument("--prompts", default=str(BUNDLED_PROMPTS),
                   help="JSONL file, one {\"prompt\": ...} or {\"messages\": [...]} (a chat, rendered with the "
                        "target's template) per line (default: the bundled code prompts), or "
                        "'heldout': the model card's held-out prompts (the first 96 tokens of 12 standard-library "
                        "files the demo models never trained on)")
    p.add_argument("--limit-prompts", type=int, help="use only the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="base seed of sampled runs (T > 0)")
    p.add_argument("--methods",
                   help=f"comma-separated, from {', '.join(ALL_METHODS)} (default: all but sps and eagle2-top; with "
                        f"--concurrency: {','.join(CONCURRENCY_METHODS)}); vanilla and hf-generate always run "
                        "(with --concurrency, vanilla): speedups are relative to them")
    p.add_argument("--grpc", action="store_true",
                   help="also run each speculative method (and vanilla) through the three gRPC services "
                        "on 127.0.0.1, as METHOD@grpc")
    p.add_argument("--openai-url", metavar="URL",
                   help="also send the prompts to this OpenAI-compatible server (e.g. http://host:8000/v1: "
                        "streamed /completions), reported as method `openai`")
    p.add_argument("--openai-model", metavar="NAME", help="its model id (default: the first it lists)")
    p.add_argument("--openai-key", metavar="KEY", default=os.environ.get("OPENAI_API_KEY") or None,
                   help="its bearer token (env OPENAI_API_KEY)")
    p.add_argument("--repeats", type=int, default=1, help="run the whole prompt set this many times")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    add_tree_flags(p)
    add_tree_sizing_flag(p)
    p.add_argument("--compare-tree-sizing", action="store_true",
                   help="also run each in-process speculative method with the other tree sizing (over the same "
                        "target), as METHOD@fixed or METHOD@cost, interleaved with the rest")
    c = p.add_argument_group("concurrency (through the gRPC services)")
    c.add_argument("--concurrency", type=_int_list, metavar="LIST",
                   help="e.g. 1,2,4,8: for each C, keep C requests in flight through the services and report "
                        "aggregate tokens/s and latency percentiles per method (replaces the in-process run)")
    c.add_argument("--requests-per-level", type=int, default=DEFAULT_REQUESTS_PER_LEVEL, metavar="N",
                   help=f"timed requests per method and level, over the prompts in turn "
                        f"(default {DEFAULT_REQUESTS_PER_LEVEL}; at least the largest C)")
    c.add_argument("--verify-token-budget", type=int, default=0, metavar="N",
                   help="the services' orchestrator cuts each session's tree to N / sessions on its verifier "
                        "(at least 4) under load; 0 = off (default)")
    p.add_argument("--lookahead", type=_int_list, default=(), metavar="LIST",
                   help="with --grpc, e.g. 1,2: also run each speculative method through an orchestrator "
                        "that drafts one round ahead for the N likeliest accepted paths (greedy sessions), "
                        "as METHOD@grpc-aheadN, over the same verifier and drafter")
    p.add_argument("--pin", action="store_true",
                   help="with --grpc: run the verifier and the drafter processes on one core each (as on devices "
                        "of their own, one torch thread each) and the in-process methods on the verifier's core "
                        "(needs 2 CPUs; implies --threads 1)")
    p.add_argument("--compare-plane", action="store_true",
                   help="with --grpc: also run each method through a twin of each orchestrator on the relay "
                        "plane (every tree and commit through the orchestrator; the default is the direct "
                        "plane, where the verifier calls the drafter itself), as METHOD@grpc-relay (and "
                        "METHOD@grpc-aheadN-relay)")
    p.add_argument("--startup-timeout", type=float, default=STARTUP_TIMEOUT_S, metavar="S",
                   help="with --grpc: seconds to wait for the services to be ready (a first start builds the "
                        "compiled graphs)")
    p.add_argument("--compare-unary", action="store_true",
                   help="with --grpc: also run each speculative method through an orchestrator that sends every "
                        "per-cycle step as a unary call instead of on the session streams, as METHOD@grpc-unary")
    s = p.add_argument_group("sweep")
    s.add_argument("--sweep-totals", type=_int_list, default=SWEEP_TOTALS,
                   help=f"total_tokens values (default {','.join(map(str, SWEEP_TOTALS))}), at --depth")
    s.add_argument("--sweep-depths", type=_int_list, default=SWEEP_DEPTHS,
                   help=f"depth values (default {','.join(map(str, SWEEP_DEPTHS))}), at --total-tokens")
    p.add_argument("--json-schema", metavar="FILE",
                   help="structured output: greedy eagle2 with and without this JSON Schema on the prompts, "
                        "reporting tau of both, valid outputs and the grammar's time per token")
    x = p.add_argument_group("prefix caching")
    x.add_argument("--prefix-cache-tokens", type=prefix_cache_tokens, metavar="N",
                   help="the in-process engines' prefix caches, N tokens (default: 0, off, since the methods run "
                        f"the same prompts; `bench prefix`: {PREFIX_CACHE_TOKENS}); with it the hit rates and "
                        "saved prefill tokens are reported")
    x.add_argument("--prefix-cache-exact", action="store_true",
                   help="prefill in block-aligned chunks so that a hit gives the very bits of a miss "
                        "(specdec.model.prefix_cache)")
    x.add_argument("--system-tokens", type=int, default=1000, metavar="N",
                   help="`bench prefix`: tokens of the shared system prompt (default 1000); requests: "
                        "--limit-prompts (default 4) of --prompts, each after it, method: the first of --methods "
                        "(default eagle2)")
    p.add_argument("--json", required=True, metavar="OUT.json", help="write the results here")
    p.add_argument("--report", metavar="DIR", help="write results.md and PNG plots here")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    add_profile_flags(p)
    p.set_defaults(run=run)


def add_profile_flags(p) -> None:
    g = p.add_argument_group("profile (`specdec bench profile`)")
    g.add_argument("--prefix", type=int, default=128, help="cached tokens before each profiled step (default 128)")
    g.add_argument("--steps", type=int, default=30, help="timed runs per step (default 30)")
    g.add_argument("--e2e-prompts", type=int, default=0, metavar="N",
                   help="also decode N prompts with vanilla and eagle2, eager and compiled verifier side by side")
    g.add_argument("--startup", action="store_true",
                   help="also time start-up in fresh processes: eager, compiled cold and warm inductor cache")
    g.add_argument("--startup-only", action="store_true", help=argparse.SUPPRESS)   # one start-up, timed
    g.add_argument("--batches", type=_int_list, default=(), metavar="LIST",
                   help="with --compile: also time batched verification of B sessions for each B (e.g. 2,4,8): "
                        "eager, compiled row by row, compiled batched")
    g.add_argument("--prefill", type=_int_list, default=(), metavar="LIST",
                   help="with --compile: also time a prefill of each prompt length (e.g. 96,192,400), eager and "
                        "compiled")
    g.add_argument("--cycle", action="store_true",
                   help="count per speculative cycle instead: host syncs (values read back, tensors made from host "
                        "data, value-shaped operators), eager operators and graph replays, per method (--methods, "
                        f"default {','.join(CYCLE_METHODS)}) and per code site; on CUDA also the device's "
                        "synchronising calls and kernel / graph launches (specdec.bench.cycle_profile)")
    for flag, kind, default, what in (("--top-k", int, 0, "top-k"), ("--top-p", float, 1.0, "top-p"),
                                      ("--min-p", float, 0.0, "min-p"),
                                      ("--repetition-penalty", float, 1.0, "repetition penalty"),
                                      ("--presence-penalty", float, 0.0, "presence penalty"),
                                      ("--frequency-penalty", float, 0.0, "frequency penalty")):
        g.add_argument(flag, type=kind, default=default, help=f"with --cycle: the sampling's {what} "
                                                              f"(default {default}; with --temperature)")


def _methods(text: str) -> tuple[str, ...]:
    from specdec.bench.runner import ALL_METHODS
    names = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    bad = [m for m in names if m not in ALL_METHODS]
    if bad or not names:
        raise UsageError(f"unknown method {bad[0]!r} in --methods; choose from {', '.join(ALL_METHODS)}" if bad
                       else "--methods is empty")
    return names


def config_from(args, sweep: bool):
    """Flags -> BenchConfig, checking only the model directories the run needs."""
    from specdec.bench.runner import DEFAULT_METHODS, SPECULATIVE, BenchConfig, with_references
    for flag, value, low in (("--max-new-tokens", args.max_new_tokens, 1), ("--repeats", args.repeats, 1),
                             ("--limit-prompts", args.limit_prompts, 1), ("--threads", args.threads, 1),
                             ("--verify-token-budget", args.verify_token_budget, 0)):
        if value is not None and value < low:
            raise UsageError(f"{flag} must be >= {low}, got {value}")
    if any(not 1 <= n <= 8 for n in args.lookahead):
        raise UsageError(f"--lookahead values must be in [1, 8], got {','.join(map(str, args.lookahead))}")
    if args.lookahead and not args.grpc:
        raise UsageError("--lookahead needs --grpc (in-process methods have no round trip to hide)")
    for flag in ("pin", "compare_unary", "compare_plane"):
        if getattr(args, flag) and not args.grpc:
            raise UsageError(f"--{flag.replace('_', '-')} needs --grpc")
    if not args.startup_timeout > 0:
        raise UsageError(f"--startup-timeout must be > 0 seconds, got {args.startup_timeout}")
    if args.pin and args.threads not in (None, 1):
        raise UsageError(f"--pin runs one torch thread per process, got --threads {args.threads}")
    if args.pin:
        try:
            pinned_cores()
        except ValueError as exc:
            raise UsageError(f"--pin: {exc}") from None
    from specdec.request.params import TreeParams

    tree = TreeParams(total_tokens=args.total_tokens, depth=args.depth, expand_k=args.expand_k,
                      value_temperature=args.value_temperature, proposals=args.proposals)
    if sweep:
        methods = ("vanilla", "eagle2")
    elif args.concurrency:
        from specdec.bench.concurrency import concurrency_methods

        methods = concurrency_methods(_methods(args.methods or ",".join(CONCURRENCY_METHODS)))
    else:
        methods = with_references(_methods(args.methods or ",".join(DEFAULT_METHODS)))
    kinds = {SPECULATIVE[m][0] for m in methods if m in SPECULATIVE}
    target = model_dir(args.target, "target", "target model", "--target")
    eagle = model_dir(args.eagle, "eagle", "EAGLE head", "--eagle") if "eagle" in kinds else args.eagle
    eagle3 = model_dir(args.eagle3, "eagle3", "EAGLE-3 head", "--eagle3") if "eagle3" in kinds else args.eagle3
    medusa = medusa_dir(args.medusa) if "medusa" in kinds else args.medusa
    hydra = hydra_dir(args.hydra) if "hydra" in kinds else args.hydra
    needs_lm = "draft-lm" in kinds or "hf-assisted" in methods
    draft_lm = model_dir(args.draft_lm, "draft-lm", "draft LM", "--draft-lm") if needs_lm else args.draft_lm
    return BenchConfig(target=target, eagle=eagle, draft_lm=draft_lm, eagle3=eagle3, medusa=medusa, hydra=hydra,
                       methods=methods,
                       max_new_tokens=args.max_new_tokens, temperature=args.temperature, tree=tree,
                       repeats=args.repeats, seed=args.seed, grpc=args.grpc and not sweep, dtype=args.dtype,
                       weights=args.weights,
                       device=args.device, compile=args.compile, verify_token_budget=args.verify_token_budget,
                       tree_sizing="fixed" if sweep else args.tree_sizing,
                       compare_tree_sizing=args.compare_tree_sizing and not sweep,
                       min_tau=resolved_min_tau(args.min_tau),
                       lookahead=tuple(dict.fromkeys(args.lookahead)), compare_unary=args.compare_unary,
                       compare_plane=args.compare_plane, startup_timeout_s=args.startup_timeout,
                       pin=args.pin and args.grpc and not sweep, openai_url=args.openai_url,
                       openai_model=args.openai_model, openai_key=args.openai_key,
                       prefix_cache_tokens=args.prefix_cache_tokens or 0, prefix_cache_exact=args.prefix_cache_exact,
                       lookahead_wng=args.lookahead_wng)


def concurrency_plan(args):
    from specdec.bench.concurrency import ConcurrencyPlan
    try:
        return ConcurrencyPlan(levels=args.concurrency, requests=args.requests_per_level)
    except ValueError as exc:
        raise UsageError(f"--concurrency / --requests-per-level: {exc}") from None


HELDOUT = "heldout"      # --prompts heldout: the model card's held-out corpus prompts


def load_prompts(path: str, limit: int | None, target: str | None = None) -> list:
    """Prompt texts, or chats (``{"messages": [...]}`` lines) the bench renders with the target's template."""
    if path == HELDOUT:
        from specdec.model.loading import load_tokenizer
        from specdec.train.card import heldout_prompt_texts

        prompts = heldout_prompt_texts(load_tokenizer(target))
    else:
        prompts = read_prompts(argparse.Namespace(prompt=None, prompt_file=path))
    return prompts[:limit] if limit else prompts


def run(args) -> int:
    import torch

    from specdec.bench.runner import stderr_progress
    if args.mode == "profile":
        return run_profile_command(args)
    if args.mode == "prefix":
        return run_prefix_command(args)
    if args.json_schema:
        return run_structured_command(args)
    sweep = args.mode == "sweep"
    if args.concurrency and sweep:
        raise UsageError("--concurrency does not combine with `bench sweep`")
    if args.openai_url and (sweep or args.concurrency):
        raise UsageError("--openai-url runs with the side-by-side bench only (not sweep or --concurrency)")
    plan = concurrency_plan(args) if args.concurrency else None
    cfg = config_from(args, sweep)
    prompts = load_prompts(args.prompts, args.limit_prompts, cfg.target)
    if args.pin:
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    progress = None if args.quiet else stderr_progress("bench sweep" if sweep else "bench")
    out = Path(args.json)
    if out.parent and not out.parent.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
    if sweep:
        from specdec.bench.sweep import run_sweep, sweep_markdown, write_sweep_report

        for t in args.sweep_totals + args.sweep_depths:
            if t < 1:
                raise ValueError(f"sweep values must be >= 1, got {t}")
        result = run_sweep(cfg, prompts, args.sweep_totals, args.sweep_depths, progress)
        out.write_text(json.dumps(result, indent=2) + "\n")
        if args.report:
            write_sweep_report(result, args.report)
        print(sweep_markdown(result))
        return 0
    if plan is not None:
        from specdec.bench.concurrency import run_concurrency
        from specdec.bench.report import concurrency_markdown, write_concurrency_report

        result = run_concurrency(cfg, plan, prompts, progress)
        out.write_text(json.dumps(result, indent=2) + "\n")
        if args.report:
            write_concurrency_report(result, args.report)
        print(concurrency_markdown(result))
        return 0
    from specdec.bench.report import markdown, write_report
    from specdec.bench.suite import run_bench

    result = run_bench(cfg, prompts, progress)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if args.report:
        write_report(result, args.report)
    print(markdown(result))
    return 0


def run_prefix_command(args) -> int:
    """``specdec bench prefix``: time to first token over a shared system prompt (``specdec.bench.prefix``)."""
    import torch

    from specdec.bench.prefix import prefix_markdown, run_prefix_bench
    from specdec.bench.runner import stderr_progress
    if args.grpc or args.concurrency or args.openai_url:
        raise UsageError("`bench prefix` runs in process: no --grpc, --concurrency or --openai-url")
    tokens = PREFIX_CACHE_TOKENS if args.prefix_cache_tokens is None else args.prefix_cache_tokens
    if not 1 <= args.system_tokens or tokens < args.system_tokens:
        raise UsageError(f"--system-tokens must be >= 1 and fit in --prefix-cache-tokens ({tokens}), "
                         f"got {args.system_tokens}")
    names = _methods(args.methods or "eagle2")
    cfg = replace(config_from(argparse.Namespace(**{**vars(args), "methods": names[0]}), sweep=False),
                  methods=names[:1])
    limit = args.limit_prompts or 4
    if limit < 2:
        raise UsageError("`bench prefix` needs --limit-prompts >= 2 (the second request is the warm one)")
    prompts = load_prompts(args.prompts, None, cfg.target)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run_prefix_bench(cfg, prompts, args.system_tokens, limit, tokens,
                              None if args.quiet else stderr_progress("bench prefix"))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(prefix_markdown(result))
    return 0


def run_profile_command(args) -> int:
    import torch

    from specdec.bench.profile import profile_markdown, run_profile
    if args.cycle:
        return run_cycle_command(args)
    if (args.batches or args.prefill) and args.compile == "off":
        raise UsageError("--batches and --prefill compare the eager and compiled paths: add --compile on")
    if any(b < 1 for b in args.batches) or any(n < 1 for n in args.prefill):
        raise UsageError("--batches and --prefill take positive integers")
    if args.threads:
        torch.set_num_threads(args.threads)
    # a target of your own with no head yet: its steps only
    eagle = None if args.target and not args.eagle else model_dir(args.eagle, "eagle", "EAGLE head", "--eagle")
    if eagle is None and (args.e2e_prompts or args.startup or args.startup_only):
        raise UsageError("--e2e-prompts and --startup decode with an EAGLE head: add --eagle")
    result = run_profile(args, model_dir(args.target, "target", "target model", "--target"), eagle)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(profile_markdown(result))
    return 0


def run_cycle_command(args) -> int:
    """``specdec bench profile --cycle``: host syncs, eager operators and replays per cycle."""
    import torch

    from specdec.bench.cycle_profile import cycle_markdown, run_cycle_profile
    from specdec.bench.runner import SPECULATIVE, stderr_progress
    from specdec.request.errors import InvalidArgument
    from specdec.request.params import SamplingParams
    try:
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                  min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                                  presence_penalty=args.presence_penalty,
                                  frequency_penalty=args.frequency_penalty).validate()
    except InvalidArgument as exc:
        raise UsageError(str(exc)) from None
    names = _methods(args.methods or ",".join(CYCLE_METHODS))
    bad = [m for m in names if m != "vanilla" and m not in SPECULATIVE]
    if bad:
        raise UsageError(f"--cycle counts the in-process methods, not {bad[0]!r}")
    cfg = replace(config_from(argparse.Namespace(**{**vars(args), "methods": ",".join(names)}), sweep=False),
                  methods=names)
    prompts = load_prompts(args.prompts, args.limit_prompts, cfg.target)
    if args.threads:
        torch.set_num_threads(args.threads)
    progress = None if args.quiet else stderr_progress("bench profile --cycle")
    result = run_cycle_profile(cfg, prompts, sampling, progress)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(cycle_markdown(result))
    return 0


def run_structured_command(args) -> int:
    """``specdec bench --json-schema FILE``: tau with and without the schema (``specdec.bench.structured``)."""
    import torch

    from specdec.bench.runner import stderr_progress
    from specdec.bench.structured import run_structured, structured_markdown
    from specdec.request.errors import InvalidArgument
    from specdec.request.params import TreeParams
    try:
        schema = Path(args.json_schema).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--json-schema: cannot read {args.json_schema}: {exc}") from None
    target = model_dir(args.target, "target", "target model", "--target")
    eagle = model_dir(args.eagle, "eagle", "EAGLE head", "--eagle")
    if args.threads:
        torch.set_num_threads(args.threads)
    tree = TreeParams(total_tokens=args.total_tokens, depth=args.depth, expand_k=args.expand_k)
    progress = None if args.quiet else stderr_progress("bench --json-schema")
    try:
        result = run_structured(target, eagle, load_prompts(args.prompts, args.limit_prompts, target), schema,
                                args.max_new_tokens, tree, progress)
    except InvalidArgument as exc:
        raise UsageError(str(exc)) from None
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(structured_markdown(result))
    return 0
