"""Model card for the bundled demo family: measured, never typed in.

Collects each model's training log (steps, tokens, time, held-out loss vs the
unigram baseline), sizes, and measures on this machine the cost of one target
forward of one token against one EAGLE-head draft step (one node, and a
frontier of expand_k nodes), both over a 200-token prefix. The calibration
table and plot (EAGLE-2 §3.2, Figure 6) come from ``specdec.bench``.
"""

from __future__ import annotations

import json
import math
import platform
import time
from pathlib import Path

import torch

from specdec import kv


def _timed(fn, repeats: int = 30) -> float:
    for _ in range(5):
        fn()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats


@torch.inference_mode()
def step_costs(target_dir: Path, eagle_dir: Path, prefix: int = 200, frontier: int = 8,
               threads: int = 2) -> dict[str, float]:
    """Seconds per: target forward of 1 token; head step of 1 node; head step
    of a ``frontier``-node tree level (each incl. lm_head and log-softmax)."""
    from drafter.eagle import EagleDrafter
    from specdec.models import ModelSpec
    from verifier.engine import TargetModel

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        target = TargetModel(ModelSpec(str(target_dir)))
        ids = torch.randint(0, target.vocab_size, (prefix,))
        cache = target.new_cache()
        feats, _ = target.forward(cache, ids, torch.arange(prefix), None)

        def target_step():
            target.forward(cache, ids[:1], torch.tensor([prefix]), None)
            kv.truncate(cache, prefix)

        drafter = EagleDrafter(eagle_dir, target_dir)
        drafter.prefill("card", ids.tolist() + [1], feats)
        sess = drafter.sessions.get("card")
        sess.cache = drafter._new_cache()
        drafter._feed_pending(sess)
        past = kv.seq_len(sess.cache)

        def head_step(k: int):
            tokens = ids[:k]
            mask = torch.zeros(1, 1, k, past + k)
            drafter._step(sess, tokens, feats[:k], torch.full((k,), past), mask)
            kv.truncate(sess.cache, past)

        t = _timed(target_step)
        h1 = _timed(lambda: head_step(1))
        hk = _timed(lambda: head_step(frontier))
    finally:
        torch.set_num_threads(old)
    return {"target_token_s": t, "head_step_1_s": h1, f"head_step_{frontier}_s": hk,
            "ratio_1": t / h1, f"ratio_{frontier}": t / hk, "threads": threads, "prefix": prefix}


def _params(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return total


def _log(model_dir: Path) -> dict:
    path = model_dir / "training_log.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def collect(demo: Path, measure: bool = True) -> dict:
    card: dict = {"machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
                  "models": {}}
    for name in ("target", "draft-lm", "eagle"):
        d = demo / name
        if not d.is_dir():
            continue
        log = _log(d)
        evals = log.get("evals", [])
        card["models"][name] = {
            "params": _params(d), "bytes_on_disk": sum(f.stat().st_size for f in d.glob("*.safetensors")),
            "steps": log.get("config", {}).get("steps"), "batch": log.get("config", {}).get("batch"),
            "seq_len": log.get("config", {}).get("seq_len"), "train_seconds": round(log.get("train_seconds", 0.0)),
            "train_tokens_seen": (log.get("config", {}).get("steps") or 0) * (log.get("config", {}).get("batch") or 0)
            * (log.get("config", {}).get("seq_len") or 0),
            "last_eval": evals[-1] if evals else None, "unigram_loss": log.get("unigram_loss"),
        }
    if measure and (demo / "target").is_dir() and (demo / "eagle").is_dir():
        card["step_costs"] = step_costs(demo / "target", demo / "eagle")
    return card
