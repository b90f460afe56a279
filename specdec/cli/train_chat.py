"""Chat data for EAGLE heads: ``specdec train chat-prompts|chat-regenerate`` and
``specdec train eagle --chat FILE [--regenerate]`` (specdec/train/chat_heads.py).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdec.request.errors import UsageError


def add_chat_flags(p: argparse.ArgumentParser) -> None:
    """The chat-data flags of ``train eagle``."""
    g = p.add_argument_group("chat data (instead of --data)")
    g.add_argument("--chat", metavar="JSONL", nargs="+",
                   help="conversations, one {\"messages\": [{\"role\", \"content\"}, ...]} a line (several "
                        "files: one dataset, a conversation given twice kept once), rendered with the target's "
                        "chat template; only assistant tokens are trained on")
    g.add_argument("--heldout-chat", metavar="JSONL", nargs="+",
                   help="held-out conversations for evals and calibration (default: ~5%% of --chat, by hash); "
                        "a training conversation equal to one of them is left out of training")
    g.add_argument("--regenerate", action="store_true",
                   help="replace every assistant turn with the target's own answer (self-distillation; "
                        "written to <workdir>/regenerated-*.jsonl and reused on rerun)")
    _generation_flags(g, "regen-", max_new=256, temperature=0.0)
    g.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: the target's regeneration and feature extraction and the head's forward under "
                        "bf16 autocast (weights and optimizer state stay fp32); ~2x faster where the CPU or GPU "
                        "has bf16")


def _precision_flag(t) -> None:
    t.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: the target's weights in bf16 and its forwards under bf16 autocast (~1.8x the "
                        "tokens a second where the CPU has bf16; answers can part from fp32's at near-ties)")


def _generation_flags(g, prefix: str, max_new: int, temperature: float) -> None:
    g.add_argument(f"--{prefix}max-new-tokens", type=int, default=max_new, help="answer length bound")
    g.add_argument(f"--{prefix}batch", type=int, default=16, help="conversations generated at once")
    g.add_argument(f"--{prefix}temperature", type=float, default=temperature,
                   help=f"sampling temperature (0: greedy; default {temperature})")


def add_parsers(tsub) -> None:
    t = tsub.add_parser("chat-prompts", help="user prompts sampled from the target's own user header (Magpie), "
                                             "de-duplicated, with a held-out split")
    t.add_argument("--target", required=True, help="chat model: a directory or a GGUF file")
    t.add_argument("--n", type=int, required=True, help="prompts to keep (train and held-out together)")
    t.add_argument("--out", required=True, help="training prompts (JSONL of messages); every draw is journaled "
                                                "beside it (OUT.draws.jsonl) and a rerun goes on from there")
    t.add_argument("--heldout-out", help="held-out prompts (default: OUT with .heldout.jsonl)")
    t.add_argument("--heldout-frac", type=float, default=0.05, help="share of prompts held out (by hash)")
    t.add_argument("--max-draws", type=int, default=0, help="samples drawn at most (default 4 * --n)")
    t.add_argument("--exclude", nargs="+", default=[], metavar="JSONL",
                   help="conversations whose user turns count as already drawn (prompts of an earlier run, "
                        "held-out ones included): a draw that repeats one is dropped as a duplicate")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    _precision_flag(t)
    _generation_flags(t, "", max_new=128, temperature=1.0)
    t.set_defaults(run=run_chat_prompts)

    t = tsub.add_parser("chat-regenerate", help="conversations with every assistant turn the target's own answer")
    t.add_argument("--target", required=True, help="chat model: a directory or a GGUF file")
    t.add_argument("--chat", required=True, help="conversations (JSONL of messages; a trailing user turn is answered)")
    t.add_argument("--out", required=True, help="regenerated conversations (JSONL; a rerun completes it)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    _precision_flag(t)
    _generation_flags(t, "", max_new=256, temperature=0.0)
    t.set_defaults(run=run_chat_regenerate)

    t = tsub.add_parser("chat-card", help="measure a chat head on held-out chat prompts and write its MODEL_CARD.md")
    t.add_argument("--target", required=True, help="chat model: a directory, a GGUF file or pypi:PACKAGE")
    t.add_argument("--eagle", required=True, help="the head's directory (written by train eagle --chat)")
    t.add_argument("--prompts", required=True, help="held-out chats (JSONL of messages; each up to its last user turn)")
    t.add_argument("--n", type=int, default=24, help="prompts measured (the file's first N)")
    t.add_argument("--max-new-tokens", type=int, default=96)
    t.add_argument("--dtype", default="float32", help="the target's dtype while measuring")
    t.add_argument("--out", help="where card.json, calibration.png and MODEL_CARD.md go (default: the head's parent)")
    t.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    t.set_defaults(run=run_chat_card)


def _generation(max_new: int, batch: int, temperature: float, seed: int = 0, precision: str = "fp32"):
    from specdec.train.regenerate import GenerateOptions

    if max_new < 1 or batch < 1 or temperature < 0:
        raise UsageError(f"max new tokens and batch must be >= 1 and temperature >= 0, "
                         f"got {max_new}, {batch}, {temperature}")
    return GenerateOptions(max_new_tokens=max_new, batch=batch, temperature=temperature, seed=seed,
                           precision=precision)


def _target(args):
    """The frozen target and its tokenizer; at ``--precision bf16`` its weights in bf16 (a generating
    command owns its copy: bf16 weights read half the bytes and skip autocast's casts of them)."""
    import torch

    from specdec.cli.options import model_dir
    from specdec.train.chat_heads import load_frozen

    if args.threads:
        torch.set_num_threads(args.threads)
    args.target = model_dir(args.target, "target", "target model", "--target")
    target, tokenizer = load_frozen(Path(args.target))
    return (target.to(torch.bfloat16) if args.precision == "bf16" else target), tokenizer


def run_chat_prompts(args) -> int:
    from specdec.train.magpie import MagpieOptions, excluded_prompts, journal_path, sample_prompts, write_prompts

    if args.n < 1 or not 0 <= args.heldout_frac < 1:
        raise UsageError(f"--n must be >= 1 and --heldout-frac in [0, 1), got {args.n}, {args.heldout_frac}")
    gen = _generation(args.max_new_tokens, args.batch, args.temperature)
    opts = MagpieOptions(n=args.n, max_new_tokens=gen.max_new_tokens, batch=gen.batch,
                         temperature=gen.temperature, heldout_frac=args.heldout_frac, max_draws=args.max_draws,
                         seed=args.seed, precision=args.precision)
    excluded = excluded_prompts(args.exclude)
    target, tokenizer = _target(args)
    t0 = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    kept = sample_prompts(target, tokenizer, opts, journal=journal_path(out), excluded=excluded)
    heldout = Path(args.heldout_out) if args.heldout_out else out.with_suffix(".heldout.jsonl")
    train, held = write_prompts(kept.kept, out, heldout, args.heldout_frac)
    seconds = time.perf_counter() - t0
    new_tokens = kept.tokens - kept.replayed[1]
    print(json.dumps({"drawn": kept.drawn, "resumed_draws": kept.replayed[0], "excluded": len(excluded),
                      "kept": len(kept.kept),
                      "dropped": kept.dropped, "train": train, "heldout": held, "tokens": kept.tokens,
                      "seconds": round(seconds, 1), "tokens_per_s": round(new_tokens / seconds, 1),
                      "out": str(out), "heldout_out": str(heldout)}))
    return 0


def run_chat_regenerate(args) -> int:
    from specdec.train.chat import read_chats
    from specdec.train.regenerate import regenerate

    gen = _generation(args.max_new_tokens, args.batch, args.temperature, args.seed, args.precision)
    chats = read_chats(args.chat, need_assistant=False)
    target, tokenizer = _target(args)
    t0 = time.perf_counter()
    _, generated, tokens = regenerate(target, tokenizer, chats, Path(args.out), gen)
    seconds = time.perf_counter() - t0
    print(json.dumps({"conversations": len(chats), "generated": generated, "tokens": tokens,
                      "seconds": round(seconds, 1), "tokens_per_s": round(tokens / seconds, 1), "out": args.out}))
    return 0


def chat_data(args):
    """The ``ChatData`` of ``train eagle``'s chat flags."""
    from specdec.train.chat import chat_key, read_chat_files
    from specdec.train.chat_heads import ChatData

    if args.data:
        raise UsageError("--data (text files) and --chat (conversations) do not go together")
    if args.heldout_chat and not args.chat:
        raise UsageError("--heldout-chat needs --chat")
    need = not args.regenerate
    regen = _generation(args.regen_max_new_tokens, args.regen_batch, args.regen_temperature, args.seed,
                        args.precision) if args.regenerate else None
    heldout = read_chat_files(args.heldout_chat, need) if args.heldout_chat else None
    held_keys = {chat_key(c) for c in heldout or []}
    return ChatData([c for c in read_chat_files(args.chat, need) if chat_key(c) not in held_keys], heldout, regen)


def run_eagle_chat(args, out: str, cfg, loss=None, opts=None) -> dict:
    from specdec.train.chat_heads import train_chat_head
    from specdec.train.eagle import EagleLoss
    from specdec.train.eagle3 import Eagle3Options

    data = chat_data(args)
    return train_chat_head(3 if args.version == 3 else 2, Path(args.target), data, Path(out),
                           Path(args.workdir) if args.workdir else Path.home() / ".cache" / "specdec" / "train"
                           / f"{args.name}-chat", cfg, loss or EagleLoss(), opts or Eagle3Options(),
                           progress=not args.no_progress, precision=args.precision)


def run_chat_card(args) -> int:
    import torch

    from specdec.cli.options import model_dir
    from specdec.train.chat_card import write_chat_card

    if args.n < 1 or args.max_new_tokens < 1:
        raise UsageError(f"--n and --max-new-tokens must be >= 1, got {args.n} and {args.max_new_tokens}")
    if not Path(args.prompts).is_file():
        raise UsageError(f"--prompts: file not found: {args.prompts}")
    if args.threads:
        torch.set_num_threads(args.threads)
    target = model_dir(args.target, "target", "target model", "--target")
    head = Path(model_dir(args.eagle, "eagle", "EAGLE head", "--eagle"))
    try:
        out = write_chat_card(args.target, target, head, Path(args.prompts), Path(args.out) if args.out else head.parent,
                              args.n, args.max_new_tokens, args.dtype)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(f"model card written to {out}")
    return 0
