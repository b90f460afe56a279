"""A small resumable training loop shared by the target, draft-LM and EAGLE trainers.

Checkpoints (model, optimizer, step) are written atomically every
``ckpt_every`` steps and on SIGTERM/SIGINT, so a run killed at any point
resumes from its last checkpoint with the same data order (see data.py).
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 4000
    batch: int = 16
    seq_len: int = 256
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    ckpt_every: int = 50
    eval_every: int = 250
    threads: int = 0  # 0: leave torch's default
    stop_after: int = 0  # >0: checkpoint and return after this many steps in this invocation


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train(
    cfg: TrainConfig,
    params: list[torch.nn.Parameter],
    modules: dict[str, torch.nn.Module],
    loss_fn: Callable[[int], tuple[torch.Tensor, dict[str, float]]],
    eval_fn: Callable[[], dict[str, float]] | None,
    workdir: Path,
    progress: bool = True,
) -> dict:
    """Run ``cfg.steps`` optimizer steps of ``loss_fn(step)``; resume from
    ``workdir/checkpoint.pt`` if present. Returns the log of the run."""
    from tqdm import tqdm

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt_path = workdir / "checkpoint.pt"
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    log: dict = {"config": asdict(cfg), "history": [], "evals": [], "train_seconds": 0.0}
    step = 0
    if ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False)
        for name, module in modules.items():
            module.load_state_dict(state["modules"][name])
        opt.load_state_dict(state["optimizer"])
        step, log = state["step"], state["log"]
        if log.get("config") != asdict(cfg):     # resumed with other flags (e.g. more --steps): say so
            log.setdefault("resumed", []).append({"at_step": step, "config": asdict(cfg)})
            log["config"] = asdict(cfg)

    stop = {"now": False}

    def _on_signal(signum, frame):  # finish the current step, checkpoint, exit
        stop["now"] = True

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    def checkpoint() -> None:
        _atomic_save({"modules": {n: m.state_dict() for n, m in modules.items()},
                      "optimizer": opt.state_dict(), "step": step, "log": log}, ckpt_path)
        (workdir / "log.json").write_text(json.dumps(log, indent=1))

    bar = tqdm(total=cfg.steps, initial=step, disable=not progress, dynamic_ncols=True)
    last = min(cfg.steps, step + cfg.stop_after) if cfg.stop_after else cfg.steps
    try:
        while step < last and not stop["now"]:
            t0 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = lr_at(cfg, step)
            for m in modules.values():
                m.train()
            loss, extra = loss_fn(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            step += 1
            log["train_seconds"] += time.perf_counter() - t0
            log["history"].append({"step": step, "loss": float(loss.detach()), **extra})
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
            if eval_fn is not None and (step % cfg.eval_every == 0 or step == cfg.steps):
                with torch.no_grad():
                    for m in modules.values():
                        m.eval()
                    result = {"step": step, **eval_fn()}
                log["evals"].append(result)
                bar.write(json.dumps(result))
            if step % cfg.ckpt_every == 0 or step == cfg.steps:
                checkpoint()
        checkpoint()
    finally:
        bar.close()
        for s, h in old.items():
            signal.signal(s, h)
    log["finished"] = step >= cfg.steps
    return log
