"""Train an EAGLE-1/2 head for any local causal-LM target.

Per window of corpus tokens the frozen target gives features F (final-norm
hidden states) and next-token distributions. The head sees
(embed(x_{t+1}), F_t + noise) and is trained to predict F_{t+1}
(smooth-L1 regression) and the target's distribution at t+1 through the
frozen lm_head and the target's own final-logit processing (soft
cross-entropy), as in EAGLE (arXiv:2401.15077, §4.2):
loss = w_reg * L_reg + w_cls * L_cls, uniform feature noise for robustness to
the head's own errors when it drafts several steps ahead. The target is read
only through transformers' public API (decoder hidden states, input and output
embeddings: ``drafter.eagle.eagle2_head.TargetHead``), so any family trains a head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.train.data import eval_windows, frozen_target, sample_batch, tokenize_stream
from specdec.train.loop import TrainConfig, train
from drafter.base import CALIBRATION_FILE
from drafter.eagle.eagle2_head import EagleHead, TargetHead, head_config, head_config_for, save_head


@dataclass(frozen=True)
class EagleLoss:
    w_reg: float = 1.0
    w_cls: float = 0.1
    noise: float = 0.2           # uniform noise in [-noise/2, noise/2] added to input features


def head_from_target(target) -> EagleHead:
    cfg = head_config(head_config_for(target.config))
    head = EagleHead(cfg, bias=True)
    # Start the decoder layer from the target's last layer where it has the
    # same tensors (a Llama-like layer): a far better start than random for a
    # feature regressor. Other families start from the random init.
    layers = getattr(target.get_decoder(), "layers", None)
    if layers is not None:
        own = head.layers[0].state_dict()
        last = {k: v for k, v in layers[-1].state_dict().items()
                if k in own and own[k].shape == v.shape and not k.startswith("input_layernorm")}
        head.layers[0].load_state_dict(last, strict=False)
    return head.float()


def eagle_losses(head: EagleHead, target, batch: torch.Tensor, loss_cfg: EagleLoss, noise_gen=None):
    """batch: [B, L+1] token windows. Returns (loss, metrics)."""
    tokens = batch[:, :-1]
    with torch.no_grad():
        feats = target.get_decoder()(input_ids=tokens).last_hidden_state.float()      # [B, L, H]
    return feature_losses(head, TargetHead.of_model(target), tokens, feats, loss_cfg, noise_gen)


def masked_mean(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """Mean of x [B, T] over the positions ``weight`` [B, T] (bool) keeps (all when None)."""
    if weight is None:
        return x.mean()
    w = weight.float()
    return (x * w).sum() / w.sum().clamp(min=1.0)


def feature_losses(head: EagleHead, io: TargetHead, tokens: torch.Tensor, feats: torch.Tensor,
                   loss_cfg: EagleLoss, noise_gen=None, mask: torch.Tensor | None = None):
    """The losses of ``head`` given the target's features ``feats`` [B, L, H] of
    ``tokens`` [B, L]; ``mask`` [B, L] bool: the target positions whose
    predictions count (None: all). The head at t stands for position t + 1."""
    with torch.no_grad():
        target_logp = torch.log_softmax(io.logits(feats), -1)
        embed = io.embed_tokens(tokens[:, 1:]).float()                                # x_{t+1}
    weight = None if mask is None else mask[:, 1:]
    inp = feats[:, :-1]
    if loss_cfg.noise:
        noise = torch.rand(inp.shape, generator=noise_gen) - 0.5
        inp = inp + loss_cfg.noise * noise
    positions = torch.arange(inp.shape[1])[None].expand(inp.shape[0], -1)
    out = head(embed, inp, positions)                                                  # [B, L-1, H]
    want = feats[:, 1:]
    reg = masked_mean(F.smooth_l1_loss(out, want, reduction="none").mean(-1), weight)
    logp = torch.log_softmax(io.logits(out), -1)
    p = target_logp[:, 1:].exp()
    cls = masked_mean(-(p * logp).sum(-1), weight)
    top1 = masked_mean((logp.argmax(-1) == target_logp[:, 1:].argmax(-1)).float(), weight)
    return loss_cfg.w_reg * reg + loss_cfg.w_cls * cls, {"reg": float(reg.detach()), "cls": float(cls.detach()),
                                                         "top1": float(top1)}


# Candidate greedy value temperatures, 0.10 to 2.00.
TEMPERATURE_GRID = tuple(round(0.05 * i, 2) for i in range(2, 41))


@torch.no_grad()
def heldout_head_logits(head: EagleHead, target, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's next-token logits on held-out windows [B, L+1] (teacher-forced
    with the target's features, as at the first draft level) and the target's
    argmax at each position: ([N, V] fp32, [N] int64)."""
    tokens = windows[:, :-1]
    io = TargetHead.of_model(target)
    feats = target.get_decoder()(input_ids=tokens).last_hidden_state.float()
    labels = io.logits(feats).argmax(-1)[:, 1:]
    embed = io.embed_tokens(tokens[:, 1:]).float()
    positions = torch.arange(feats.shape[1] - 1)[None].expand(feats.shape[0], -1)
    logits = io.logits(head.float()(embed, feats[:, :-1], positions))
    return logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)


def fit_value_temperature(logits: torch.Tensor, labels: torch.Tensor,
                          grid=TEMPERATURE_GRID) -> tuple[float, dict[float, float]]:
    """Temperature scaling for argmax acceptance: the t on ``grid`` whose
    softmax(logits / t) gives the target's argmax ``labels`` the least
    negative log-likelihood. Returns (t, {t: NLL})."""
    nll = {t: float(F.cross_entropy(logits / t, labels)) for t in grid}
    return min(nll, key=nll.get), nll


def calibration_record(logits: torch.Tensor, labels: torch.Tensor) -> dict:
    """The fitted greedy value temperature of head ``logits`` [N, V'] against the
    target's argmax ``labels`` [N] (ids in the head's own vocabulary), with the
    numbers that justify it: what ``calibration.json`` holds."""
    t, nll = fit_value_temperature(logits, labels)
    top = torch.softmax(logits / t, -1).max(-1).values.mean()
    return {"greedy_value_temperature": t,
            "fitted_on": f"{labels.numel()} held-out positions: NLL of the target's argmax",
            "heldout_nll": {"1.0": round(nll[1.0], 4), str(t): round(nll[t], 4)},
            "top1_agreement": round(float((logits.argmax(-1) == labels).float().mean()), 4),
            "mean_top1_confidence": {"1.0": round(float(torch.softmax(logits, -1).max(-1).values.mean()), 4),
                                     str(t): round(float(top), 4)}}


def write_calibration(record: dict, out_dir: Path) -> dict:
    """Write ``record`` to ``out_dir/calibration.json`` (read by the drafter)."""
    Path(out_dir, CALIBRATION_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return record


def calibrate_head(head: EagleHead, target, heldout_stream: torch.Tensor, out_dir: Path,
                   seq_len: int = 256, windows: int = 8) -> dict:
    """Fit the head's greedy value temperature on held-out text and write it to
    ``out_dir/calibration.json`` (read by the drafter)."""
    logits, labels = heldout_head_logits(head, target, eval_windows(heldout_stream, seq_len, max_windows=windows))
    return write_calibration(calibration_record(logits, labels), out_dir)


def train_eagle(target_dir: Path, train_texts: list[str], heldout_texts: list[str], out_dir: Path,
                workdir: Path, cfg: TrainConfig, loss_cfg: EagleLoss = EagleLoss(), progress: bool = True) -> dict:
    torch.manual_seed(cfg.seed)
    target, tokenizer = frozen_target(target_dir)
    train_stream = tokenize_stream(train_texts, tokenizer, cache=workdir)
    heldout_stream = tokenize_stream(heldout_texts, tokenizer, cache=workdir)
    head = head_from_target(target)
    heldout = eval_windows(heldout_stream, cfg.seq_len, max_windows=16)
    noise_gen = torch.Generator().manual_seed(cfg.seed)

    def loss_fn(step: int):
        noise_gen.manual_seed(cfg.seed * 7919 + step)
        return eagle_losses(head, target, sample_batch(train_stream, cfg.batch, cfg.seq_len, cfg.seed, step),
                            loss_cfg, noise_gen)

    def eval_fn():
        _, metrics = eagle_losses(head, target, heldout, EagleLoss(loss_cfg.w_reg, loss_cfg.w_cls, 0.0))
        return {f"heldout_{k}": v for k, v in metrics.items()}

    log = train(cfg, [p for p in head.parameters() if p.requires_grad], {"head": head}, loss_fn, eval_fn,
                workdir, progress)
    if not log["finished"]:
        return log          # interrupted: the checkpoint resumes it; export only a finished head
    head.eval()
    save_head(head, out_dir)
    calibrate_head(head, target, heldout_stream, out_dir, cfg.seq_len)
    (Path(out_dir) / "training_log.json").write_text(json.dumps(
        {k: v for k, v in log.items() if k != "history"} | {"history_tail": log["history"][-20:],
                                                            "target": str(target_dir)}, indent=1))
    return log
