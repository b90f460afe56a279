"""``specdec train tokenizer|target|draft-lm|eagle [--version 3] [--chat]|chat-prompts|chat-regenerate|medusa|
hydra|calibrate|card``.

Each command is resumable: it checkpoints into ``--workdir`` every
``--ckpt-every`` steps and on SIGTERM/Ctrl-C, and a rerun with the same flags
continues where it stopped. With no ``--data`` the corpus is the Python
standard library of this interpreter (see specdec/train/corpus.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specdec.cli.train_chat import add_chat_flags, add_parsers as add_chat_parsers, run_eagle_chat
from specdec.model.loading import demo_path
from specdec.request.errors import UsageError

# The demo family's shapes (the bundled models were trained with these).
TARGET_SHAPE = dict(hidden=192, layers=20, heads=4, kv_heads=2, intermediate=512)
DRAFT_LM_SHAPE = dict(hidden=128, layers=2, heads=2, kv_heads=2, intermediate=384)
EAGLE_VERSIONS = (1, 2, 3)      # 1 and 2 share one head format and one trainer


def _corpus(args) -> tuple[list[str], list[str]]:
    from specdec.train.corpus import is_heldout, read_texts, stdlib_split

    if not args.data:
        split = stdlib_split()
        return read_texts(split.train), read_texts(split.heldout)
    paths = [Path(p) for p in args.data]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise UsageError(f"data file not found: {missing[0]}")
    held = [p for p in paths if is_heldout(p.name)] or paths[-1:]
    train = [p for p in paths if p not in held] or held
    return read_texts(train), read_texts(held)


def _common(p: argparse.ArgumentParser, steps: int, batch: int, lr: float) -> None:
    p.add_argument("--data", nargs="+", help="text files (default: the stdlib corpus)")
    p.add_argument("--workdir", help="checkpoint directory (default: ~/.cache/specdec/train/<name>)")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--stop-after", type=int, default=0,
                   help="checkpoint and stop after this many steps (rerun to resume)")
    p.add_argument("--no-progress", action="store_true")


def _shape(p: argparse.ArgumentParser, shape: dict) -> None:
    for name, value in shape.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train the demo family or an EAGLE head for your target")
    tsub = p.add_subparsers(dest="what", required=True)

    t = tsub.add_parser("tokenizer", help="byte-level BPE tokenizer")
    t.add_argument("--data", nargs="+")
    t.add_argument("--out", default=str(demo_path("tokenizer")))
    t.add_argument("--vocab-size", type=int, default=4096)
    t.set_defaults(run=run_tokenizer)

    for name, shape, steps, lr in (("target", TARGET_SHAPE, 1600, 2e-3), ("draft-lm", DRAFT_LM_SHAPE, 800, 3e-3)):
        t = tsub.add_parser(name, help=f"Llama causal LM ({name})")
        t.add_argument("--tokenizer", default=str(demo_path("tokenizer")))
        t.add_argument("--out", default=str(demo_path(name)))
        _common(t, steps=steps, batch=16, lr=lr)
        _shape(t, shape)
        t.set_defaults(run=run_lm, name=name)

    t = tsub.add_parser("card", help="measure the demo family and write its MODEL_CARD.md + calibration plot")
    t.add_argument("--demo", default=str(demo_path("target").parent), help="family directory (default: bundled)")
    t.add_argument("--prompts", type=int, default=12, help="held-out prompts for tau and calibration")
    t.add_argument("--max-new-tokens", type=int, default=128)
    t.set_defaults(run=run_card)

    t = tsub.add_parser("calibrate", help="fit an EAGLE head's greedy value temperature on held-out text "
                                          "(writes calibration.json beside the head; train eagle does it too)")
    t.add_argument("--target", default=str(demo_path("target")))
    t.add_argument("--eagle", default=str(demo_path("eagle")), help="head directory (written into)")
    t.add_argument("--data", nargs="+", help="text files (default: the Python standard library's held-out part)")
    t.add_argument("--seq-len", type=int, default=256)
    t.set_defaults(run=run_calibrate, name="calibrate")

    t = tsub.add_parser("eagle", help="EAGLE-1/2 or EAGLE-3 head for any local causal-LM target")
    t.add_argument("--target", default=str(demo_path("target")))
    t.add_argument("--version", type=int, choices=EAGLE_VERSIONS, default=2,
                   help="2: an EAGLE-1/2 head (one format); 3: an EAGLE-3 head (reference layout)")
    t.add_argument("--out", help="head directory (default: the bundled eagle/ or eagle3/)")
    v2 = t.add_argument_group("EAGLE-1/2 (--version 2)")
    v2.add_argument("--w-reg", type=float, default=None, help="feature regression weight (default 1.0)")
    v2.add_argument("--w-cls", type=float, default=None, help="soft cross-entropy weight (default 0.1)")
    v2.add_argument("--noise", type=float, default=None, help="uniform input-feature noise (default 0.2)")
    v3 = t.add_argument_group("EAGLE-3 (--version 3)")
    v3.add_argument("--draft-vocab", type=int, default=None,
                    help="draft vocabulary size: the corpus's most frequent tokens (default V/4, at most 32000)")
    v3.add_argument("--ttt-steps", type=int, default=None,
                    help="training-time-test steps the head is unrolled for (default 7)")
    v3.add_argument("--feature-layers", default=None, metavar="I,J,K",
                    help="the three target hidden states the head reads, as HF hidden-state indices "
                         "(the input of layer i; 0..L-1): default the reference's 2, L//2, L-3")
    v3.add_argument("--init", default=None, metavar="HEAD_DIR",
                    help="start from this EAGLE-3 head's weights and draft vocabulary (e.g. to fine-tune it "
                         "on other feature layers) instead of the target's own tensors")
    _common(t, steps=800, batch=16, lr=1e-3)
    add_chat_flags(t)
    t.set_defaults(run=run_eagle, name="eagle")
    add_chat_parsers(tsub)

    t = tsub.add_parser("medusa", help="Medusa-1 heads on a frozen local causal-LM target")
    t.add_argument("--target", default=str(demo_path("target")))
    t.add_argument("--out", help="heads directory (default: the bundled medusa/)")
    t.add_argument("--heads", type=int, default=4, help="Medusa heads (head k predicts the token k + 2 ahead)")
    t.add_argument("--layers", type=int, default=1, help="residual blocks per head")
    t.add_argument("--layout", choices=("original", "vllm"), default="original",
                   help="original: medusa_lm_head.safetensors (default); vllm: model.safetensors, model_type medusa")
    _common(t, steps=300, batch=8, lr=1e-3)
    t.set_defaults(run=run_medusa, name="medusa")

    t = tsub.add_parser("hydra", help="Hydra heads (path-dependent) on a frozen local causal-LM target")
    t.add_argument("--target", default=str(demo_path("target")))
    t.add_argument("--out", help="heads directory (default: the bundled hydra/)")
    t.add_argument("--heads", type=int, default=4, help="Hydra heads (head i predicts depth i + 1 below the root)")
    t.add_argument("--layers", type=int, default=1, help="residual blocks per head (>= 1)")
    t.add_argument("--arch", choices=("mlp", "prefix-mlp"), default="mlp",
                   help="hydra_head_arch: mlp, or Hydra++'s prefix-mlp (one decoder layer shaped like the target's "
                        "over its hidden states, whose output the heads read)")
    _common(t, steps=300, batch=8, lr=1e-3)
    t.set_defaults(run=run_hydra, name="hydra")


def _config(args):
    from specdec.train.loop import TrainConfig

    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    warmup = args.warmup if args.warmup is not None else min(150, max(1, args.steps // 10))
    return TrainConfig(steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr, warmup=warmup,
                       seed=args.seed, ckpt_every=args.ckpt_every, eval_every=args.eval_every,
                       threads=args.threads, stop_after=args.stop_after)


def _workdir(args) -> Path:
    return Path(args.workdir) if args.workdir else Path.home() / ".cache" / "specdec" / "train" / args.name


def run_tokenizer(args) -> int:
    from specdec.train.tokenizer import train_tokenizer

    args.name = "tokenizer"
    texts, _ = _corpus(args)
    out = train_tokenizer(texts, args.out, args.vocab_size)
    print(f"tokenizer saved to {out}")
    return 0


def run_lm(args) -> int:
    from specdec.train.lm import LmShape, train_lm

    train_texts, heldout = _corpus(args)
    shape = LmShape(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                    intermediate=args.intermediate)
    log = train_lm(Path(args.tokenizer), train_texts, heldout, Path(args.out), _workdir(args), shape,
                   _config(args), progress=not args.no_progress)
    _report(log, args.out)
    return 0


def run_eagle(args) -> int:
    from specdec.cli.options import model_dir

    args.target = model_dir(args.target, "target", "target model", "--target")
    other = ("w_reg", "w_cls", "noise") if args.version == 3 else ("draft_vocab", "ttt_steps", "feature_layers",
                                                                   "init")
    given = [f"--{name.replace('_', '-')}" for name in other if getattr(args, name) is not None]
    if given:
        raise UsageError(f"{', '.join(given)} do not apply to --version {args.version}")
    if (args.regenerate or args.heldout_chat or args.precision != "fp32") and not args.chat:
        raise UsageError("--regenerate, --heldout-chat and --precision need --chat")
    if args.version == 3:
        return _run_eagle3(args)
    from specdec.train.eagle import EagleLoss, train_eagle

    d = EagleLoss()
    loss = EagleLoss(w_reg=d.w_reg if args.w_reg is None else args.w_reg,
                     w_cls=d.w_cls if args.w_cls is None else args.w_cls,
                     noise=d.noise if args.noise is None else args.noise)
    out = args.out or str(demo_path("eagle"))
    if args.chat:
        _report(run_eagle_chat(args, out, _config(args), loss=loss), out)
        return 0
    train_texts, heldout = _corpus(args)
    log = train_eagle(Path(args.target), train_texts, heldout, Path(out), _workdir(args), _config(args),
                      loss, progress=not args.no_progress)
    _report(log, out)
    return 0


def run_medusa(args) -> int:
    from specdec.cli.options import model_dir
    from specdec.train.medusa import MedusaOptions, train_medusa

    args.target = model_dir(args.target, "target", "target model", "--target")
    if args.heads < 1 or args.layers < 0:
        raise UsageError(f"--heads must be >= 1 and --layers >= 0, got {args.heads} and {args.layers}")
    out = args.out or str(demo_path("medusa"))
    train_texts, heldout = _corpus(args)
    log = train_medusa(Path(args.target), train_texts, heldout, Path(out), _workdir(args), _config(args),
                       MedusaOptions(args.heads, args.layers, args.layout), progress=not args.no_progress)
    _report(log, out)
    return 0


def run_hydra(args) -> int:
    from specdec.cli.options import model_dir
    from specdec.train.hydra import HydraOptions, train_hydra

    args.target = model_dir(args.target, "target", "target model", "--target")
    if args.heads < 1 or args.layers < 1:
        raise UsageError(f"--heads and --layers must be >= 1, got {args.heads} and {args.layers}")
    out = args.out or str(demo_path("hydra"))
    train_texts, heldout = _corpus(args)
    log = train_hydra(Path(args.target), train_texts, heldout, Path(out), _workdir(args), _config(args),
                      HydraOptions(args.heads, args.layers, args.arch), progress=not args.no_progress)
    _report(log, out)
    return 0


def _run_eagle3(args) -> int:
    from specdec.train.eagle3 import Eagle3Options, train_eagle3

    if args.draft_vocab is not None and args.draft_vocab < 1:
        raise UsageError(f"--draft-vocab must be >= 1, got {args.draft_vocab}")
    if args.ttt_steps is not None and args.ttt_steps < 1:
        raise UsageError(f"--ttt-steps must be >= 1, got {args.ttt_steps}")
    layers = ()
    if args.feature_layers is not None:
        try:
            layers = tuple(int(i) for i in args.feature_layers.split(","))
        except ValueError:
            raise UsageError(f"--feature-layers must be three integers like 2,10,17, got {args.feature_layers!r}")
        if len(layers) != 3:
            raise UsageError(f"--feature-layers must name three layers, got {len(layers)}")
    if args.init is not None and args.draft_vocab is not None:
        raise UsageError("--draft-vocab does not apply with --init (the head's own vocabulary is kept)")
    defaults = Eagle3Options()
    opts = Eagle3Options(draft_vocab=args.draft_vocab or defaults.draft_vocab,
                         ttt_steps=args.ttt_steps or defaults.ttt_steps, feature_layers=layers,
                         init=args.init)
    args.name = "eagle3"
    out = args.out or str(demo_path("eagle3"))
    if args.chat:
        _report(run_eagle_chat(args, out, _config(args), opts=opts), out)
        return 0
    train_texts, heldout = _corpus(args)
    log = train_eagle3(Path(args.target), train_texts, heldout, Path(out), _workdir(args), _config(args), opts,
                       progress=not args.no_progress)
    _report(log, out)
    return 0


def run_calibrate(args) -> int:
    import json

    import torch

    from drafter.eagle.eagle3_layouts import is_eagle3_config
    from drafter.eagle.eagle2_head import load_head
    from specdec.cli.options import model_dir
    from specdec.model.loading import ModelSpec, load_causal_lm, load_tokenizer, require_model_dir
    from specdec.train.data import tokenize_stream
    from specdec.train.eagle import calibrate_head

    args.target = model_dir(args.target, "target", "target model", "--target")
    eagle = require_model_dir(args.eagle, "EAGLE head")
    _, heldout = _corpus(args)
    target = load_causal_lm(ModelSpec(args.target))
    stream = tokenize_stream(heldout, load_tokenizer(args.target))
    if is_eagle3_config(json.loads((Path(eagle) / "config.json").read_text())):
        from drafter.eagle.eagle3_head import load_head3
        from specdec.train.eagle3 import calibrate_head3

        text = target.config.get_text_config(decoder=True)
        head = load_head3(eagle, torch.float32, int(text.num_hidden_layers),
                          target.get_input_embeddings().weight.float())
        result = calibrate_head3(head, target, stream, Path(eagle), args.seq_len)
    else:
        result = calibrate_head(load_head(eagle, torch.float32), target, stream, Path(eagle), args.seq_len)
    print(json.dumps(result))
    return 0


def _report(log: dict, out: str) -> None:
    last = log["evals"][-1] if log.get("evals") else {}
    state = "finished" if log.get("finished") else "stopped early (rerun to resume)"
    print(f"{state}: saved to {out}; last eval {last}")


def run_card(args) -> int:
    from specdec.train.card import write_card

    out = write_card(Path(args.demo), args.prompts, args.max_new_tokens)
    print(f"model card written to {out}")
    return 0
