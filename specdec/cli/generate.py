"""``specdec generate``: run prompts in-process (``--local``) or through a server."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec.cli.options import (add_model_flags, add_tree_flags, add_tree_sizing_flag, hydra_dir, medusa_choices,
                                 medusa_dir, model_dir, print_logprobs, prompt_text, read_prompts, resolved_min_tau,
                                 result_record)
from specdec.cli.remote import run_remote
from specdec.request import knobs
from specdec.request.constraints import Constraint, constraint_from
from specdec.request.decoding import StopCriteria
from specdec.request.errors import UsageError
from specdec.request.params import LOOKAHEAD, MAX_LOGPROBS, REQUEST_METHODS, VANILLA, SamplingParams, TreeParams

# torch-free at import: `specdec --help` and the service subcommands that
# don't need torch must not pay for (or require) it; specdec.local (torch) is
# imported by the functions that run models.


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
    p.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN=BIAS",
                   help="add BIAS in [-100, 100] to token id TOKEN's logit before sampling (repeatable; "
                        "-100 bans a token, 100 all but forces it)")
    shape = p.add_argument_group("structured output (at most one; exact under speculation)")
    one = shape.add_mutually_exclusive_group()
    one.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid under the JSON Schema in FILE")
    one.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    one.add_argument("--regex", metavar="PATTERN", help="the whole output matches the regular expression PATTERN")
    one.add_argument("--grammar", metavar="FILE", help="the output follows the Lark grammar in FILE "
                                                       "(llguidance's dialect)")
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
    add_tree_sizing_flag(p)
    p.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    p.add_argument("--prompt-file", help="JSONL file, one {\"prompt\": ...} or {\"messages\": [...]} per line")
    p.add_argument("prompt", nargs="?", help="the prompt text")
    p.add_argument("--chat", action="store_true",
                   help="send PROMPT as one user message, rendered with the target's chat template "
                        "(prompt files take {\"messages\": [...]} lines)")
    p.set_defaults(run=run)


def sampling_from(args) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          min_p=args.min_p, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty,
                          repetition_penalty=args.repetition_penalty,
                          logit_bias=logit_bias_from(args.logit_bias), constraint=constraint_from_flags(args)).validate()


def constraint_from_flags(args) -> Constraint | None:
    """``--json-schema`` / ``--json-object`` / ``--regex`` / ``--grammar`` as a constraint (bounds: its own)."""
    def read(flag: str, path: str | None) -> str | None:
        if path is None:
            return None
        try:
            return Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"{flag}: cannot read {path}: {exc}") from None

    return constraint_from(json_schema=read("--json-schema", getattr(args, "json_schema", None)),
                           regex=getattr(args, "regex", None), grammar=read("--grammar", getattr(args, "grammar", None)),
                           json_object=getattr(args, "json_object", False))


def logit_bias_from(flags: list[str]) -> tuple[tuple[int, float], ...]:
    """``--logit-bias TOKEN=BIAS`` flags as (token id, bias) pairs (bounds: ``SamplingParams``)."""
    pairs = []
    for flag in flags:
        token, _, bias = flag.partition("=")
        try:
            pairs.append((int(token), float(bias)))
        except ValueError:
            raise UsageError(f"--logit-bias takes TOKEN=BIAS (an integer and a number), got {flag!r}") from None
    return tuple(pairs)


def tree_from(args) -> TreeParams | None:
    if args.method == VANILLA:
        return None
    return TreeParams(method=args.method, total_tokens=args.total_tokens, depth=args.depth, expand_k=args.expand_k,
                      value_temperature=args.value_temperature, proposals=args.proposals)


def resolve_models(args):
    """Model flags -> (ModelSpec, DrafterChoice), defaulting to the demo family."""
    from specdec.local import DrafterChoice, default_paths
    from specdec.model.loading import ModelSpec

    demo = default_paths()
    if args.medusa_choices and args.medusa is None and getattr(args, "hydra", None) is None:
        raise UsageError("--medusa-choices needs --medusa or --hydra")
    target = model_dir(args.target, "target", "target model", "--target")
    spec = ModelSpec(path=target, dtype=args.dtype, device=args.device,
                     attn_implementation=getattr(args, "attn_implementation", "auto"),
                     compile=getattr(args, "compile", "off"), weights=getattr(args, "weights", "dtype"))
    if args.method in (VANILLA, LOOKAHEAD):             # no drafter (lookahead: the verifier drafts)
        return spec, DrafterChoice("none")
    if args.ngram:
        return spec, DrafterChoice("ngram")
    if args.medusa is not None:
        return spec, DrafterChoice("medusa", medusa_dir(args.medusa), medusa_choices(args.medusa_choices))
    if getattr(args, "hydra", None) is not None:
        return spec, DrafterChoice("hydra", hydra_dir(args.hydra), medusa_choices(args.medusa_choices))
    if args.draft_lm:
        return spec, DrafterChoice("draft-lm", model_dir(args.draft_lm, "draft-lm", "draft LM", "--draft-lm"))
    eagle = args.eagle or str(demo["eagle"])
    if not Path(eagle, "config.json").is_file():
        raise UsageError(f"EAGLE head directory {eagle} has no config.json")
    return spec, DrafterChoice("eagle", eagle)


def run(args) -> int:
    prompts = read_prompts(args)
    params = sampling_from(args)
    tree_cfg = tree_from(args)
    logprobs = args.logprobs
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise UsageError(f"--logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.server:
        return run_remote(args, prompts, params, tree_cfg)
    from specdec.local import build_local, generate

    min_tau = resolved_min_tau(args.min_tau)
    spec, choice = resolve_models(args)
    kind = LOOKAHEAD if args.method == LOOKAHEAD else choice.kind
    prior = min_tau is None                  # auto: the kind's default until the break-even is measured
    min_tau = min_tau if min_tau is not None else knobs.default_min_tau(kind)
    stack = build_local(spec, choice, tree_sizing=args.tree_sizing, prefix_cache_tokens=args.prefix_cache_tokens,
                        prefix_cache_exact=args.prefix_cache_exact, lookahead=args.lookahead_wng)
    if tree_cfg is not None and stack.drafter is not None:
        stack.verifier.target.compile_trees(tree_cfg.total_tokens)     # a tree past the start-up widths
        from drafter.compiled.whole_draft import use_budget

        use_budget(stack.drafter, tree_cfg)                             # the run's budget drafted whole
    from specdec.model.prompts import prompt_ids

    tok = stack.tokenizer
    eos = {i for i in [tok.eos_token_id] if i is not None}
    for prompt in prompts:
        ids = prompt_ids(tok, prompt)
        stop = StopCriteria(max_new_tokens=args.max_new_tokens, eos_ids=frozenset(eos))
        dec = generate(stack.verifier, stack.drafter, ids, params, stop, tree_cfg, min_tau, logprobs=logprobs,
                       min_tau_prior=prior)
        text = tok.decode(dec.tokens, skip_special_tokens=True)
        if args.json:
            print(json.dumps(result_record(dec.tokens, text, dec.stats, None if logprobs is None else dec.logprobs)),
                  flush=True)
        else:
            print(prompt_text(prompt) + text, flush=True)
            if logprobs is not None:
                print_logprobs(dec.logprobs, tok.decode)
            s = dec.stats
            print(f"[{len(dec.tokens)} tokens, {s.cycles} cycles, tau {s.tau:.2f}, "
                  f"{len(dec.tokens) / max(s.wall_s, 1e-9):.1f} tok/s]", file=sys.stderr)
    return 0
