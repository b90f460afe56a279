"""Train Hydra heads on a frozen target (``drafter.hydra_heads``).

Hydra (Ankner et al., arXiv:2402.05109): the target is frozen; head i reads
the target's final-norm hidden state h_t and the input embeddings of the
tokens t + 1 .. t + 1 + i (teacher forcing: the corpus tokens stand in for
the drafted path) and is trained with cross-entropy against the target's own
next token after that path (its argmax at t + 1 + i: self-distillation on
hard labels, so the heads learn what a greedy verifier accepts). The heads'
losses are summed with the Medusa trainer's decaying weights
(``specdec.train.medusa.head_weights``). The first block of each head starts
as a residual projection onto the h_t slot (R = [I 0 ...], W = 0) and each
vocabulary projection as the target's lm_head (bias 0), so an untrained head
0 already guesses what the root's hidden state predicted.

``arch="prefix-mlp"`` trains Hydra++ heads: a decoder layer shaped like the
target's (``drafter.hydra_prefix``) runs causally over the hidden states and
the heads read its output in place of h_t; it is trained with them. Its
attention and MLP output projections start at zero, so it starts as its
final norm of h_t (h_t rescaled: the untrained heads' guesses are the same).

Checkpoint/resume through ``specdec.train.loop``; the finished heads are
written in the reference layout (``hydra_lm_head.safetensors`` +
config.json, fp16) with a ``calibration.json``.
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
from specdec.train.medusa import head_weights, target_view
from drafter.eagle.eagle2_head import TargetHead
from drafter.hydra_heads import HydraHeads, save_heads
from drafter.hydra_prefix import prefix_config


@dataclass(frozen=True)
class HydraOptions:
    num_heads: int = 4
    num_layers: int = 1
    arch: str = "mlp"               # or "prefix-mlp" (Hydra++)


def heads_from_target(target, opts: HydraOptions) -> HydraHeads:
    """Heads whose first block passes h_t through (prefix-mlp: the prefix
    layer's output, at first h_t rescaled), over copies of the target's lm_head."""
    io = TargetHead.of_model(target)
    vocab, hidden = io.lm_head.shape
    heads = HydraHeads(hidden, vocab, opts.num_heads, opts.num_layers,
                       prefix_config(target.config) if opts.arch == "prefix-mlp" else None)
    with torch.no_grad():
        if heads.prefix is not None:
            layer = heads.prefix.layers[0]
            for p in (*layer.self_attn.o_proj.parameters(), *layer.mlp.down_proj.parameters()):
                p.zero_()
        for mlp in heads.hydra_mlp:
            for block in mlp:
                block.linear.weight.zero_()
                block.linear.bias.zero_()
                if isinstance(block.res_connection, torch.nn.Linear):
                    block.res_connection.weight.zero_()
                    block.res_connection.weight[:, :hidden].copy_(torch.eye(hidden))
                    block.res_connection.bias.zero_()
        for lm in heads.hydra_lm_head:
            lm.weight.copy_(io.lm_head.float())
            lm.bias.zero_()
    return heads.float()


def hydra_losses(heads: HydraHeads, embed: torch.Tensor, tokens: torch.Tensor, feats: torch.Tensor,
                 labels: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """tokens [B, L], feats [B, L, H], labels [B, L] (the target's prediction
    of token t + 1 at t) -> (weighted loss, metrics). Head i at t reads
    tokens[t + 1 .. t + 1 + i] and is trained on labels[t + 1 + i]."""
    outs = heads.teacher_forced(feats, F.embedding(tokens, embed).float())
    total, metrics = 0.0, {}
    for i, (logits, weight) in enumerate(zip(outs, head_weights(heads.num_heads))):
        want = labels[:, 1 + i: 1 + i + logits.shape[1]]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), want.reshape(-1))
        total = total + weight * ce
        metrics[f"ce{i}"] = float(ce.detach())
        metrics[f"top1_{i}"] = float((logits.argmax(-1) == want).float().mean())
    return total, metrics


@torch.no_grad()
def calibrate_heads(heads: HydraHeads, embed, tokens, feats, labels, out_dir: Path) -> dict:
    """Fit the heads' greedy value temperature on held-out positions; write ``calibration.json``."""
    outs = heads.teacher_forced(feats, F.embedding(tokens, embed).float())
    rows = [o.reshape(-1, o.shape[-1]) for o in outs]
    want = [labels[:, 1 + i: 1 + i + o.shape[1]].reshape(-1) for i, o in enumerate(outs)]
    return write_calibration(calibration_record(torch.cat(rows).float(), torch.cat(want)), out_dir)


def train_hydra(target_dir: Path, train_texts: list[str], heldout_texts: list[str], out_dir: Path,
                workdir: Path, cfg: TrainConfig, opts: HydraOptions = HydraOptions(),
                progress: bool = True) -> dict:
    torch.manual_seed(cfg.seed)
    target, tokenizer = frozen_target(target_dir)
    embed = TargetHead.of_model(target).embed.float()
    train_stream = tokenize_stream(train_texts, tokenizer, cache=workdir)
    heldout_stream = tokenize_stream(heldout_texts, tokenizer, cache=workdir)
    heads = heads_from_target(target, opts)
    held_tokens = eval_windows(heldout_stream, cfg.seq_len, max_windows=8)[:, :-1]
    heldout = (held_tokens, *target_view(target, held_tokens))

    def loss_fn(step: int):
        batch = sample_batch(train_stream, cfg.batch, cfg.seq_len, cfg.seed, step)[:, :-1]
        return hydra_losses(heads, embed, batch, *target_view(target, batch))

    def eval_fn():
        _, metrics = hydra_losses(heads, embed, *heldout)
        return {f"heldout_{k}": round(v, 4) for k, v in metrics.items()}

    log = train(cfg, list(heads.parameters()), {"heads": heads}, loss_fn, eval_fn, workdir, progress)
    if not log["finished"]:
        return log          # interrupted: the checkpoint resumes it; export only finished heads
    heads.eval()
    save_heads(heads, out_dir, dtype=torch.float16)
    calibrate_heads(heads, embed, *heldout, Path(out_dir))
    (Path(out_dir) / "training_log.json").write_text(json.dumps(
        {k: v for k, v in log.items() if k != "history"} | {"history_tail": log["history"][-20:],
                                                            "target": str(target_dir), "num_heads": opts.num_heads,
                                                            "arch": opts.arch,
                                                            "num_layers": opts.num_layers,
                                                            "loss_weights": head_weights(opts.num_heads)},
        indent=1))
    return log
