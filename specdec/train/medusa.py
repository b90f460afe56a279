"""Train Medusa-1 heads on a frozen target (``drafter.medusa_heads``).

Medusa-1 (Cai et al., arXiv:2401.10774, §2.2.1): the target is frozen; head
k reads the target's final-norm hidden state f_t and is trained with
cross-entropy to predict the token at t + 2 + k. The labels here are the
target's own next tokens (its argmax at t + 1 + k on the corpus window:
self-distillation, so the heads learn what a greedy verifier accepts, with no
need for the text the target was trained on). The heads' losses are summed
with decaying weights, head k weighted 0.2 * 0.8^k (the axolotl recipe's
``medusa_heads_coefficient`` and ``medusa_decay_coefficient``): later heads
are harder and should not dominate. Blocks start as the identity (zero
linear weights, as the reference initialises them) and each vocabulary
projection as the target's lm_head, so an untrained head 0 already guesses
"the token after the root is what the root predicted".

Checkpoint/resume through ``specdec.train.loop``; the finished heads are
written in the original layout (``medusa_lm_head.safetensors`` + config.json),
or vLLM's (``layout="vllm"``), with a ``calibration.json`` fitting their
greedy value temperature.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.train.data import eval_windows, frozen_target, sample_batch, tokenize_stream
from specdec.train.eagle import calibration_record, write_calibration
from specdec.train.loop import TrainConfig, train
from drafter.eagle.eagle2_head import TargetHead
from drafter.medusa_heads import MedusaHeads, save_heads

HEADS_COEFFICIENT = 0.2
DECAY = 0.8


@dataclass(frozen=True)
class MedusaOptions:
    num_heads: int = 4
    num_layers: int = 1
    layout: str = "original"      # drafter.medusa_heads.LAYOUTS


def head_weights(num_heads: int) -> list[float]:
    """The loss weight of each head: 0.2 * 0.8^k."""
    return [HEADS_COEFFICIENT * DECAY ** k for k in range(num_heads)]


def heads_from_target(target, opts: MedusaOptions) -> MedusaHeads:
    """Heads of identity blocks over copies of the target's lm_head."""
    io = TargetHead.of_model(target)
    vocab, hidden = io.lm_head.shape
    heads = MedusaHeads(hidden, vocab, opts.num_heads, opts.num_layers)
    with torch.no_grad():
        for blocks in heads.blocks:
            for block in blocks:
                block.linear.weight.zero_()
                block.linear.bias.zero_()
        for lm in heads.lm_heads:
            lm.weight.copy_(io.lm_head.float())
    return heads.float()


def target_view(target, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, L] -> (final-norm hidden states [B, L, H] fp32, the target's
    next-token argmax [B, L])."""
    with torch.no_grad():
        feats = target.get_decoder()(input_ids=tokens).last_hidden_state.float()
        labels = TargetHead.of_model(target).logits(feats).argmax(-1)
    return feats, labels


def medusa_losses(heads: MedusaHeads, feats: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """feats [B, L, H], labels [B, L] (the target's prediction of token t + 1
    at t) -> (weighted loss, metrics). Head k at t is trained on labels[t + 1 + k]."""
    logits = heads(feats)                                  # [B, L, K, V]
    total, metrics = 0.0, {}
    for k, weight in enumerate(head_weights(heads.num_heads)):
        shift = 1 + k
        if shift >= feats.shape[1]:
            break
        head_logits = logits[:, :-shift, k]                # [B, L - shift, V]
        want = labels[:, shift:]
        ce = F.cross_entropy(head_logits.reshape(-1, head_logits.shape[-1]), want.reshape(-1))
        total = total + weight * ce
        metrics[f"ce{k}"] = float(ce.detach())
        metrics[f"top1_{k}"] = float((head_logits.argmax(-1) == want).float().mean())
    return total, metrics


@torch.no_grad()
def calibrate_heads(heads: MedusaHeads, feats: torch.Tensor, labels: torch.Tensor, out_dir: Path) -> dict:
    """Fit the heads' greedy value temperature (one for all heads) on held-out
    positions and write ``calibration.json``."""
    logits = heads(feats)
    rows, want = [], []
    for k in range(heads.num_heads):
        shift = 1 + k
        if shift < feats.shape[1]:
            rows.append(logits[:, :-shift, k].reshape(-1, logits.shape[-1]))
            want.append(labels[:, shift:].reshape(-1))
    return write_calibration(calibration_record(torch.cat(rows).float(), torch.cat(want)), out_dir)


def train_medusa(target_dir: Path, train_texts: list[str], heldout_texts: list[str], out_dir: Path,
                 workdir: Path, cfg: TrainConfig, opts: MedusaOptions = MedusaOptions(),
                 progress: bool = True) -> dict:
    torch.manual_seed(cfg.seed)
    target, tokenizer = frozen_target(target_dir)
    train_stream = tokenize_stream(train_texts, tokenizer, cache=workdir)
    heldout_stream = tokenize_stream(heldout_texts, tokenizer, cache=workdir)
    heads = heads_from_target(target, opts)
    heldout = target_view(target, eval_windows(heldout_stream, cfg.seq_len, max_windows=8)[:, :-1])

    def loss_fn(step: int):
        batch = sample_batch(train_stream, cfg.batch, cfg.seq_len, cfg.seed, step)[:, :-1]
        return medusa_losses(heads, *target_view(target, batch))

    def eval_fn():
        _, metrics = medusa_losses(heads, *heldout)
        return {f"heldout_{k}": round(v, 4) for k, v in metrics.items()}

    log = train(cfg, list(heads.parameters()), {"heads": heads}, loss_fn, eval_fn, workdir, progress)
    if not log["finished"]:
        return log          # interrupted: the checkpoint resumes it; export only finished heads
    heads.eval()
    save_heads(heads, out_dir, opts.layout, dtype=torch.float16)     # as the EAGLE trainer ships heads
    calibrate_heads(heads, *heldout, Path(out_dir))
    (Path(out_dir) / "training_log.json").write_text(json.dumps(
        {k: v for k, v in log.items() if k != "history"} | {"history_tail": log["history"][-20:],
                                                            "target": str(target_dir), "num_heads": opts.num_heads,
                                                            "num_layers": opts.num_layers,
                                                            "loss_weights": head_weights(opts.num_heads)},
        indent=1))
    return log
