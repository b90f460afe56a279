"""EAGLE-1/2 and EAGLE-3 heads trained from conversations.

The steps, each resumable from ``workdir``:

1. the conversations (``specdec.train.chat``) are split into train and held-out
   by hash, and with ``regenerate`` their assistant turns are replaced by the
   target's own (``specdec.train.regenerate``: ``regenerated-train.jsonl``,
   ``regenerated-heldout.jsonl``);
2. each conversation is rendered with the target's chat template and goes
   through the target once; its features are cached on disk
   (``specdec.train.features``);
3. the head trains on batches of cached conversations with the losses of the
   text trainers (``eagle.feature_losses``, ``ttt.unrolled_losses``), counted
   only where the next token is the assistant's; held-out conversations give
   the evals and the greedy value temperature (``calibration.json``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from drafter.eagle.eagle2_head import TargetHead
from specdec.train.data import frozen_target
from specdec.train.chat import ChatTokens, chat_tokens, require_template, split_chats
from specdec.train.eagle import EagleLoss, calibration_record, feature_losses, head_from_target, write_calibration
from specdec.train.eagle3 import Eagle3Options, build_head, chosen_layers
from specdec.train.features import FeatureCache, cache_dir, extract
from specdec.train.loop import TrainConfig, train
from specdec.train.regenerate import GenerateOptions, autocast, regenerate
from specdec.train.ttt import TttBatch, unrolled_losses

EVAL_CHATS = 16         # held-out conversations in an eval


@dataclass(frozen=True)
class ChatData:
    chats: list[list[dict]]
    heldout: list[list[dict]] | None = None     # None: split ``chats`` by hash
    regenerate: GenerateOptions | None = None   # None: train on the assistant turns as given


def load_frozen(target_dir: Path):
    target, tokenizer = frozen_target(target_dir)
    require_template(tokenizer, str(target_dir))
    return target, tokenizer


def conversations(target, tokenizer, data: ChatData, workdir: Path, progress: bool):
    """(train, held-out) conversations, regenerated when asked (step 1)."""
    train_chats, held = (data.chats, data.heldout) if data.heldout is not None else split_chats(data.chats)
    if data.regenerate is None:
        return train_chats, held
    out = []
    for name, part in (("train", train_chats), ("heldout", held)):
        chats, _, _ = regenerate(target, tokenizer, part, workdir / f"regenerated-{name}.jsonl", data.regenerate,
                              progress)
        out.append(chats)
    return out[0], out[1]


def cached(target, target_dir: Path, tokens: list[ChatTokens], workdir: Path, max_len: int,
           layers: tuple[int, ...], progress: bool, precision: str = "fp32") -> tuple[FeatureCache, tuple[int, int]]:
    """The feature cache of ``tokens`` (step 2) and how many conversations and
    tokens this call put through the target."""
    directory = cache_dir(workdir, target_dir, tokens, max_len, layers, precision)
    with autocast(precision, target.device.type):
        computed = extract(target, tokens, directory, max_len, layers, progress=progress)
    return FeatureCache(directory), computed


def prepare(target, tokenizer, target_dir: Path, data: ChatData, workdir: Path, max_len: int,
            layers: tuple[int, ...], progress: bool, precision: str = "fp32"):
    """Steps 1 and 2: the train and held-out caches, and what the feature
    extraction of this call did ({"conversations", "tokens", "seconds"})."""
    train_chats, held = conversations(target, tokenizer, data, workdir, progress)
    caches, done = [], {"conversations": 0, "tokens": 0, "seconds": 0.0}
    for chats in (train_chats, held):
        t0 = time.perf_counter()
        cache, (n, tokens) = cached(target, target_dir, [chat_tokens(tokenizer, c) for c in chats], workdir,
                                    max_len, layers, progress, precision)
        caches.append(cache)
        done = {"conversations": done["conversations"] + n, "tokens": done["tokens"] + tokens,
                "seconds": round(done["seconds"] + time.perf_counter() - t0, 2)}
    return caches[0], caches[1], done


def eval_batch(cache: FeatureCache) -> dict[str, torch.Tensor]:
    return cache.batch(list(range(min(EVAL_CHATS, len(cache)))))


def eagle_batch_losses(head, io: TargetHead, b: dict, loss_cfg: EagleLoss, noise_gen=None):
    return feature_losses(head, io, b["tokens"], b["final"], loss_cfg, noise_gen, b["mask"])


def ttt_batch(io: TargetHead, b: dict, t2d: torch.Tensor) -> TttBatch:
    """A cached batch as the unrolled head reads it (``eagle3.target_batch``, from
    the cache). The target's logits are taken only where the batch trains (its
    assistant positions); elsewhere the target is zeros and nothing counts."""
    weight = b["mask"][:, 1:]                                                         # [B, S]
    with torch.no_grad():
        logits = io.logits(b["final"][:, 1:][weight])                                 # [M, V]
        target = logits.new_zeros(*weight.shape, int(t2d.sum()))
        target[weight] = logits[:, t2d]
        in_draft = torch.zeros_like(weight)
        in_draft[weight] = t2d[logits.argmax(-1)]
    return TttBatch(features=b["layers"][:, :-1], tokens=b["tokens"], target=target, in_draft=in_draft,
                    weight=weight)


def eagle3_batch_losses(head, io: TargetHead, b: dict, ttt_steps: int):
    batch = ttt_batch(io, b, head.t2d)
    loss, metrics = unrolled_losses(head, head.embed_tokens, batch, ttt_steps)
    metrics["in_draft"] = float(batch.in_draft[batch.weight].float().mean()) if batch.weight.any() else 0.0
    return loss, metrics


@torch.no_grad()
def calibrate_chat(head, io: TargetHead, b: dict, out_dir: Path, version: int) -> dict:
    """The greedy value temperature of the head's first draft step on held-out
    assistant positions, teacher-forced with the cached features."""
    weight = b["mask"][:, 1:]
    positions = torch.arange(b["tokens"].shape[1] - 1)[None].expand(b["tokens"].shape[0], -1)
    full = io.logits(b["final"][:, 1:])                                               # [B, S, V]
    if version == 3:
        embed = head.embed_tokens(b["tokens"][:, 1:])
        logits = head.draft_logits(head(embed, head.project(b["layers"][:, :-1]), positions))
        labels = full[..., head.t2d].argmax(-1)             # a draft id where the argmax is in the draft vocabulary
        keep = weight & head.t2d[full.argmax(-1)]
    else:
        embed = io.embed_tokens(b["tokens"][:, 1:]).float()
        logits, labels, keep = io.logits(head(embed, b["final"][:, :-1], positions)), full.argmax(-1), weight
    if not keep.any():
        return write_calibration({"greedy_value_temperature": 1.0,
                                  "fitted_on": "nothing: no held-out assistant position"}, out_dir)
    record = calibration_record(logits[keep], labels[keep])
    record["fitted_on"] += " (held-out conversations' assistant positions)"
    return write_calibration(record, out_dir)


def train_chat_head(version: int, target_dir: Path, data: ChatData, out_dir: Path, workdir: Path,
                    cfg: TrainConfig, loss_cfg: EagleLoss = EagleLoss(), opts: Eagle3Options = Eagle3Options(),
                    progress: bool = True, precision: str = "fp32") -> dict:
    """Train (or resume) an EAGLE head (``version`` 2 or 3) from conversations; a
    finished run writes the head, ``calibration.json`` and ``training_log.json``.
    ``precision`` "bf16" runs the target's and the head's forwards under bf16
    autocast (``autocast``); the weights, gradients and optimizer stay fp32."""
    from drafter.eagle import eagle2_head, eagle3_head

    torch.manual_seed(cfg.seed)
    workdir.mkdir(parents=True, exist_ok=True)
    max_len = cfg.seq_len + 1
    target, tokenizer = load_frozen(target_dir)
    layers = chosen_layers(target, opts) if version == 3 else ()
    train_cache, held_cache, computed = prepare(target, tokenizer, target_dir, data, workdir, max_len, layers,
                                                progress, precision)
    io = TargetHead.of_model(target)
    vocab = None
    if version == 3:
        counts = train_cache.assistant_counts(int(target.config.get_text_config(decoder=True).vocab_size))
        head, vocab = build_head(target, opts, counts, tokenizer.eos_token_id)
    else:
        head = head_from_target(target)
    held = eval_batch(held_cache)
    noise_gen = torch.Generator().manual_seed(cfg.seed)

    def loss_fn(step: int):
        b = train_cache.sample(cfg.batch, cfg.seed, step)
        with autocast(precision, target.device.type):
            if version == 3:
                return eagle3_batch_losses(head, io, b, opts.ttt_steps)
            noise_gen.manual_seed(cfg.seed * 7919 + step)
            return eagle_batch_losses(head, io, b, loss_cfg, noise_gen)

    def eval_fn():
        with autocast(precision, target.device.type):
            if version == 3:
                _, metrics = eagle3_batch_losses(head, io, held, opts.ttt_steps)
            else:
                _, metrics = eagle_batch_losses(head, io, held, EagleLoss(loss_cfg.w_reg, loss_cfg.w_cls, 0.0))
        return {f"heldout_{k}": round(v, 4) for k, v in metrics.items()}

    log = train(cfg, [p for p in head.parameters() if p.requires_grad], {"head": head}, loss_fn, eval_fn,
                workdir, progress)
    log["features_this_run"] = computed
    (workdir / "log.json").write_text(json.dumps(log, indent=1))
    if not log["finished"]:
        return log
    head.eval()
    (eagle3_head if version == 3 else eagle2_head).save_head(head, out_dir)
    calibrate_chat(head, io, held, Path(out_dir), version)
    summary = {"target": str(target_dir), "chat_train": len(train_cache), "chat_heldout": len(held_cache),
               "regenerated": data.regenerate is not None, "precision": precision}
    if vocab is not None:
        summary |= {"feature_layers": list(head.layers), "ttt_steps": opts.ttt_steps, "init": opts.init,
                    "draft_vocab": len(vocab), "draft_vocab_assistant_coverage": round(vocab.coverage, 4)}
    (Path(out_dir) / "training_log.json").write_text(json.dumps(
        {k: v for k, v in log.items() if k != "history"} | {"history_tail": log["history"][-20:]} | summary,
        indent=1))
    return log
