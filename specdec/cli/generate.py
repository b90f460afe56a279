"""``specdec generate``: run prompts in-process (``--local``) or through a server."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec import knobs
from specdec.decoding import StopCriteria
from specdec.params import MAX_LOGPROBS, PROPOSALS, REQUEST_METHODS, VANILLA, SamplingParams, TreeParams

# torch-free at import: `specdec --help` and the service subcommands that
# don't need torch must not pay for (or require) it.


def add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models (default: the bundled demo family)")
    g.add_argument("--target", help="target model directory (HF causal LM)")
    d = g.add_mutually_exclusive_group()
    d.add_argument("--eagle", help="EAGLE-1/2 head directory (EAGLE checkpoint layout)")
    d.add_argument("--draft-lm", help="small causal LM directory sharing the target's tokenizer")
    d.add_argument("--ngram", action="store_true", help="prompt-lookup drafter (no model)")
    g.add_argument("--dtype", default="float32", help="float32 (default), float16 or bfloat16")
    g.add_argument("--device", default="cpu", help="torch device of the models with --local, e.g. cuda:0")


def resolved_min_tau(text: str) -> float | None:
    """--min-tau as a number, or None for auto (by drafter kind); CliError when malformed."""
    from specdec.cli.main import CliError

    try:
        return knobs.parse_min_tau(text)
    except ValueError as exc:
        raise CliError(f"--min-tau: {exc}") from None


def add_tree_flags(p: argparse.ArgumentParser) -> None:
    """Draft tree knobs and the speculation gate (generate and bench)."""
    p.add_argument("--total-tokens", type=int, default=knobs.DEFAULT_TOTAL_TOKENS,
                   help="draft tree size incl. the root")
    p.add_argument("--depth", type=int, default=knobs.DEFAULT_DEPTH, help="deepest draft level")
    p.add_argument("--expand-k", type=int, default=knobs.DEFAULT_EXPAND_K, help="top-k per expansion")
    p.add_argument("--min-tau", default="auto", metavar="TAU",
                   help="pause drafting while a session's recent cycles commit fewer tokens than this on average "
                        "(root-only cycles until drafting pays again; output unchanged; 0 = always draft; "
                        f"default auto: {knobs.DEFAULT_MIN_TAU:g}, {knobs.NGRAM_MIN_TAU:g} for the n-gram drafter)")
    p.add_argument("--value-temperature", type=float, metavar="T",
                   help="divide draft logits by T when ranking tree nodes (default: the drafter's fitted value "
                        "for greedy, 1 when sampling); never changes the output")
    p.add_argument("--proposals", default=knobs.DEFAULT_PROPOSALS, choices=PROPOSALS,
                   help="how draft tokens are proposed when sampling (T > 0): sampled = drawn from the draft "
                        "distribution and accepted by recursive rejection sampling, top = the draft's most likely "
                        "tokens; auto (default): sampled where the drafter has a distribution (not n-gram); "
                        "never changes the output distribution")


def add_decoding_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default=knobs.DEFAULT_METHOD, choices=REQUEST_METHODS)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below MIN_P x the top probability (0 = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="[-2, 2]: subtracted once from every token already generated (0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="[-2, 2]: subtracted per occurrence among the generated tokens (0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0: divides positive (multiplies negative) logits of tokens in prompt or output (1 = off)")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="each token's logprob (raw model) with N top alternatives (0..20), in --json output "
                        "or on stderr")
    add_tree_flags(p)


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for a prompt or a JSONL file of prompts")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true", help="run drafter and verifier in this process (default)")
    where.add_argument("--server", metavar="HOST:PORT", help="an orchestrator to call")
    add_model_flags(p)
    add_decoding_flags(p)
    p.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    p.add_argument("--prompt-file", help="JSONL file, one {\"prompt\": ...} per line")
    p.add_argument("prompt", nargs="?", help="the prompt text")
    p.set_defaults(run=run)


def read_prompts(args) -> list[str]:
    from specdec.cli.main import CliError

    if (args.prompt is None) == (args.prompt_file is None):
        raise CliError("give exactly one of PROMPT or --prompt-file")
    if args.prompt is not None:
        return [args.prompt]
    path = Path(args.prompt_file)
    if not path.is_file():
        raise CliError(f"prompt file not found: {path}")
    prompts = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CliError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise CliError(f"{path}:{lineno}: expected an object with a string \"prompt\"")
        prompts.append(obj["prompt"])
    if not prompts:
        raise CliError(f"prompt file {path} has no prompts")
    return prompts


def sampling_from(args) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          min_p=args.min_p, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty,
                          repetition_penalty=args.repetition_penalty).validate()


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


def tree_from(args) -> TreeParams | None:
    if args.method == VANILLA:
        return None
    return TreeParams(method=args.method, total_tokens=args.total_tokens, depth=args.depth, expand_k=args.expand_k,
                      value_temperature=args.value_temperature, proposals=args.proposals)


def resolve_models(args):
    """Model flags -> (ModelSpec, DrafterChoice), defaulting to the demo family."""
    from specdec.cli.main import CliError
    from specdec.local import DrafterChoice, default_paths
    from specdec.models import ModelSpec

    demo = default_paths()
    target = args.target or str(demo["target"])
    if not Path(target, "config.json").is_file():
        hint = "" if args.target else " (the bundled demo model is missing: pass --target or run `specdec train`)"
        raise CliError(f"target model directory {target} has no config.json{hint}")
    spec = ModelSpec(path=target, dtype=args.dtype, device=args.device)
    if args.method == VANILLA:
        return spec, DrafterChoice("none")
    if args.ngram:
        return spec, DrafterChoice("ngram")
    if args.draft_lm:
        return spec, DrafterChoice("draft-lm", args.draft_lm)
    eagle = args.eagle or str(demo["eagle"])
    if not Path(eagle, "config.json").is_file():
        raise CliError(f"EAGLE head directory {eagle} has no config.json")
    return spec, DrafterChoice("eagle", eagle)


def result_record(tokens: list[int], text: str, stats, logprobs=None) -> dict:
    record = {"token_ids": tokens, "text": text, "cycles": stats.cycles, "tau": round(stats.tau, 4),
              "accepted_per_position": list(stats.accepted_per_position), "wall_s": round(stats.wall_s, 4)}
    if logprobs is not None:
        record["logprobs"] = logprobs_record(logprobs)
    return record


def run(args) -> int:
    from specdec.cli.main import CliError

    prompts = read_prompts(args)
    params = sampling_from(args)
    tree_cfg = tree_from(args)
    logprobs = args.logprobs
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise CliError(f"--logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")
    if args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.server:
        from specdec.cli.remote import run_remote

        return run_remote(args, prompts, params, tree_cfg)
    from specdec.local import build_local, generate

    min_tau = resolved_min_tau(args.min_tau)
    spec, choice = resolve_models(args)
    min_tau = min_tau if min_tau is not None else knobs.default_min_tau(choice.kind)
    stack = build_local(spec, choice)
    tok = stack.tokenizer
    eos = {i for i in [tok.eos_token_id] if i is not None}
    for prompt in prompts:
        if not prompt:
            raise CliError("prompt must not be empty")
        ids = tok(prompt, add_special_tokens=True)["input_ids"]
        stop = StopCriteria(max_new_tokens=args.max_new_tokens, eos_ids=frozenset(eos))
        dec = generate(stack.verifier, stack.drafter, ids, params, stop, tree_cfg, min_tau, logprobs=logprobs)
        text = tok.decode(dec.tokens, skip_special_tokens=True)
        if args.json:
            print(json.dumps(result_record(dec.tokens, text, dec.stats, None if logprobs is None else dec.logprobs)),
                  flush=True)
        else:
            print(prompt + text, flush=True)
            if logprobs is not None:
                print_logprobs(dec.logprobs, tok.decode)
            s = dec.stats
            print(f"[{len(dec.tokens)} tokens, {s.cycles} cycles, tau {s.tau:.2f}, "
                  f"{len(dec.tokens) / max(s.wall_s, 1e-9):.1f} tok/s]", file=sys.stderr)
    return 0
