"""Model card for the bundled demo family: measured, never typed in.

Collects each model's training log (steps, tokens, time, held-out loss vs the
unigram baseline), sizes, and measures on this machine the cost of one target
forward of one token against one EAGLE-head draft step (one node, and a
frontier of expand_k nodes), both over a 200-token prefix. Each bundled head
(EAGLE-2 ``eagle/``, EAGLE-3 ``eagle3/``, the Medusa heads ``medusa/``, the
Hydra heads ``hydra/``) gets
its held-out tau at the same trees (EAGLE-2 dynamic trees) and its
calibration table and plot (EAGLE-2 §3.2, Figure 6), which come from
``specdec.bench``.
"""

from __future__ import annotations

import json
import math
import platform
import time
from pathlib import Path

import torch

from specdec.model import kv
from specdec.request.params import TreeParams

# the bundled heads: directory -> (bench method name, calibration plot)
HEADS = {"eagle": ("eagle2", "calibration.png"), "eagle3": ("eagle3", "calibration-eagle3.png"),
         "medusa": ("medusa", "calibration-medusa.png"), "hydra": ("hydra", "calibration-hydra.png")}
TREES = (TreeParams(), TreeParams(total_tokens=32, depth=6, expand_k=6), TreeParams(total_tokens=16, depth=10))


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
    from drafter.eagle.eagle2 import EagleDrafter
    from specdec.model.loading import ModelSpec
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
        sess = drafter.sessions.get("card")      # its prefill fed the prompt's pairs
        past = kv.seq_len(sess.cache)

        def head_step(k: int):
            tokens = ids[:k]
            allowed = torch.ones(k, past + k, dtype=torch.bool)
            drafter.step(sess, tokens, feats[:k], torch.full((k,), past), allowed, torch.arange(past + k))
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
    for name in ("target", "draft-lm", *HEADS):
        d = demo / name
        if not d.is_dir():
            continue
        log = _log(d)
        evals = log.get("evals", [])
        tail = log.get("history_tail") or [{}]
        steps = tail[-1].get("step", log.get("config", {}).get("steps"))   # trained, not scheduled
        card["models"][name] = {
            "params": _params(d), "bytes_on_disk": sum(f.stat().st_size for f in d.glob("*.safetensors")),
            "steps": steps, "batch": log.get("config", {}).get("batch"),
            "seq_len": log.get("config", {}).get("seq_len"), "train_seconds": round(log.get("train_seconds", 0.0)),
            "train_tokens_seen": (steps or 0) * (log.get("config", {}).get("batch") or 0)
            * (log.get("config", {}).get("seq_len") or 0),
            "last_eval": evals[-1] if evals else None, "unigram_loss": log.get("unigram_loss"),
        }
    for name in HEADS:
        calibration = demo / name / "calibration.json"
        if name in card["models"] and calibration.is_file():
            card["models"][name]["calibration"] = json.loads(calibration.read_text())
    if measure and (demo / "target").is_dir() and (demo / "eagle").is_dir():
        card["step_costs"] = step_costs(demo / "target", demo / "eagle")
    return card


def heldout_prompts(tokenizer, n: int = 12, prompt_tokens: int = 96) -> list[list[int]]:
    """Prompts from held-out corpus files (never trained on): the first
    ``prompt_tokens`` tokens of the first ``n`` held-out files long enough."""
    from specdec.train.corpus import read_texts, stdlib_split

    prompts = []
    for text in read_texts(stdlib_split().heldout):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= 2 * prompt_tokens:
            prompts.append(ids[:prompt_tokens])
        if len(prompts) == n:
            break
    return prompts


def heldout_prompt_texts(tokenizer, n: int = 12, prompt_tokens: int = 96) -> list[str]:
    """``heldout_prompts`` as text (what ``specdec bench --prompts heldout`` runs)."""
    return [tokenizer.decode(ids) for ids in heldout_prompts(tokenizer, n, prompt_tokens)]


def acceptance_on_heldout(demo: Path, prompts: list[list[int]], max_new_tokens: int = 128,
                          head: str = "eagle") -> dict:
    """Greedy EAGLE-2 trees from the bundled ``head`` on held-out prompts: tau
    per tree config tried, and the calibration points (draft confidence vs
    acceptance, EAGLE-2 §3.2)."""
    from specdec.bench.calibration import TreeRecorder, calibration_bins
    from specdec.request.decoding import StopCriteria
    from specdec.local import DrafterChoice, build_local, generate
    from specdec.model.loading import ModelSpec
    from specdec.request.params import SamplingParams

    kind = head if head in ("medusa", "hydra") else "eagle"
    stack = build_local(ModelSpec(str(demo / "target")), DrafterChoice(kind, str(demo / head)))
    recorder = TreeRecorder(stack.verifier)
    stop = StopCriteria(max_new_tokens=max_new_tokens)
    runs = {}
    for cfg in TREES:
        committed = cycles = 0
        for p in prompts:
            dec = generate(recorder, stack.drafter, p, SamplingParams(), stop, cfg)
            committed += sum(dec.stats.committed_per_cycle)
            cycles += dec.stats.cycles
        runs[tree_name(cfg)] = round(committed / max(cycles, 1), 3)
    return {"tau": runs, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "calibration": calibration_bins(recorder.points())}


def tree_name(cfg) -> str:
    return f"total_tokens={cfg.total_tokens},depth={cfg.depth},expand_k={cfg.expand_k}"


def format_figure(x, spec: str = ".3f") -> str:
    return "–" if x is None else format(x, spec)


def _command(name: str, models: dict, what: str, key: str | None = None, flags: str = "") -> str:
    info = models.get(key or name, {})
    cmd = f"specdec train {name}{flags} --steps {info.get('steps')}"
    return f"{cmd:<40} # {what}: {info.get('steps')} steps (batch {info.get('batch')} x {info.get('seq_len')} tokens)"


def render(card: dict) -> str:
    m = card["models"]
    lines = ["# specdec demo model family", "",
             "Trained by `specdec train` on this repository's machine; every number below was measured by "
             "`specdec train card` (which wrote this file).", "",
             "## Corpus", "",
             "Python source of the standard library of CPython 3.11.7 (`sysconfig` stdlib path, every `*.py` "
             "outside `site-packages`), split by file: held out when `sha1(relative path) % 20 == 0` "
             "(see `specdec/train/corpus.py`).", "",
             "## Commands", "",
             "```", "specdec train tokenizer                  # byte-level BPE, vocab 4096",
             _command("target", m, "this target"),
             _command("draft-lm", m, "the draft LM"),
             _command("eagle", m, "head on the target's features"),
             *([_command("eagle", m, "the EAGLE-3 head", "eagle3", " --version 3")] if "eagle3" in m else []),
             *([_command("medusa", m, "the Medusa heads")] if "medusa" in m else []),
             *([_command("hydra", m, "the Hydra heads")] if "hydra" in m else []),
             "specdec train card                       # this file", "```", "",
             "## Models", "",
             "| model | params | on disk (fp16) | steps × batch × seq | train time | held-out loss | unigram loss |",
             "|---|---|---|---|---|---|---|"]
    for name, info in m.items():
        ev = info.get("last_eval") or {}
        loss = ev.get("heldout_loss")
        lines.append(f"| {name} | {info['params'] / 1e6:.2f} M | {info['bytes_on_disk'] / 2**20:.1f} MiB | "
                     f"{info['steps']} × {info['batch']} × {info['seq_len']} | {info['train_seconds'] / 60:.0f} min | "
                     f"{format_figure(loss)} | {format_figure(info.get('unigram_loss'))} |")
    eagle = (m.get("eagle") or {}).get("last_eval") or {}
    if eagle:
        lines += ["", f"EAGLE head on held-out text: top-1 agreement with the target "
                      f"{format_figure(eagle.get('heldout_top1'))}, feature regression (smooth-L1) {format_figure(eagle.get('heldout_reg'))}, "
                      f"soft cross-entropy to the target's distribution {format_figure(eagle.get('heldout_cls'))} "
                      "(includes the target's own entropy, so not comparable with the LM losses)."]
    lines += ["", "Train time is wall time on a 2-core machine shared with other work."]
    if "step_costs" in card:
        c = card["step_costs"]
        lines += ["", "## Cost of a step (2 threads, 200-token prefix)", "",
                  f"- target forward, 1 token: {c['target_token_s'] * 1e3:.2f} ms",
                  f"- EAGLE head step, 1 node: {c['head_step_1_s'] * 1e3:.2f} ms (ratio {c['ratio_1']:.1f})",
                  f"- EAGLE head step, 8-node tree level: {c['head_step_8_s'] * 1e3:.2f} ms (ratio {c['ratio_8']:.1f})"]
    eagle3 = (m.get("eagle3") or {}).get("last_eval") or {}
    if eagle3:
        steps = sorted(int(k.rsplit("_", 1)[1]) for k in eagle3 if k.startswith("heldout_top1_"))
        lines += ["", "EAGLE-3 head on held-out text, top-1 agreement with the target at each unrolled step "
                      "(step k drafts k + 1 tokens ahead, on its own earlier outputs): "
                      + ", ".join(f"{k}: {format_figure(eagle3[f'heldout_top1_{k}'])}" for k in steps)
                      + f"; the target's argmax lies in its draft vocabulary at "
                        f"{format_figure(eagle3.get('heldout_in_draft'))} of held-out positions."]
    medusa = (m.get("medusa") or {}).get("last_eval") or {}
    if medusa:
        heads = sorted(int(k.rsplit("_", 1)[1]) for k in medusa if k.startswith("heldout_top1_"))
        lines += ["", "Medusa heads on held-out text, top-1 agreement with the target's next tokens (head k "
                      "predicts the token k + 2 ahead of the feature it reads): "
                      + ", ".join(f"{k}: {format_figure(medusa[f'heldout_top1_{k}'])}" for k in heads) + "."]
    hydra = (m.get("hydra") or {}).get("last_eval") or {}
    if hydra:
        heads = sorted(int(k.rsplit("_", 1)[1]) for k in hydra if k.startswith("heldout_top1_"))
        lines += ["", "Hydra heads on held-out text, top-1 agreement with the target's next tokens (head k "
                      "predicts the token k + 2 ahead of the feature it reads, fed the true path before it): "
                      + ", ".join(f"{k}: {format_figure(hydra[f'heldout_top1_{k}'])}" for k in heads) + "."]
    runs = {head: card[heldout_key(head)] for head in HEADS if heldout_key(head) in card}
    if runs:
        first = next(iter(runs.values()))
        names = [HEADS[h][0] for h in runs]
        lines += ["", f"## Acceptance on held-out code ({first['prompts']} prompts, greedy, "
                      f"{first['max_new_tokens']} new tokens)", "",
                  "| tree | " + " | ".join(f"tau {n}" for n in names) + " |", "|---|" + "---|" * len(names)]
        for tree in first["tau"]:
            lines.append(f"| {tree} | " + " | ".join(format_figure(r["tau"].get(tree), ".2f") for r in runs.values()) + " |")
        lines += ["", "tau counts the bonus token."]
        for head, run in runs.items():
            method, plot = HEADS[head]
            lines += ["", f"### Calibration of the {method} head (EAGLE-2 §3.2, Figure 6): draft confidence vs "
                          "acceptance rate", ""]
            fitted = card["models"].get(head, {}).get("calibration")
            if fitted:
                t = fitted["greedy_value_temperature"]
                conf = fitted.get("mean_top1_confidence", {})
                lines += [f"Greedy sessions rank the tree with the head's logits divided by T = {t} "
                          f"(`{head}/calibration.json`, fitted by temperature scaling on held-out text: mean top-1 "
                          f"confidence {conf.get('1.0')} at T = 1, {conf.get(str(t))} at T = {t}, against a top-1 "
                          f"agreement of {fitted.get('top1_agreement')}); the confidences below are those tempered "
                          "probabilities, the values the tree was built from.", ""]
            lines += [f"![calibration of {method}]({plot})", "", "| confidence | nodes | accepted | rate |",
                      "|---|---|---|---|"]
            lines += [f"| {b['lo']:.2f}–{b['hi']:.2f} | {b['nodes']} | {b['accepted']} | {format_figure(b['rate'])} |"
                      for b in run["calibration"]]
    lines += ["", f"Measured on: {card['machine']}.", ""]
    return "\n".join(lines)


def write_card(demo: Path, prompts: int = 12, max_new_tokens: int = 128) -> Path:
    from specdec.bench.report import plot_calibration
    from specdec.model.loading import load_tokenizer

    card = collect(demo)
    if (demo / "target").is_dir():
        held = heldout_prompts(load_tokenizer(demo / "target"), prompts)
        for head, (method, plot) in HEADS.items():
            if not (demo / head).is_dir():
                continue
            run = acceptance_on_heldout(demo, held, max_new_tokens, head)
            card[heldout_key(head)] = run
            plot_calibration({"bins": run["calibration"], "method": f"{method}, held-out code",
                              "evaluated_nodes": sum(b["nodes"] for b in run["calibration"])}, demo / plot)
    (demo / "card.json").write_text(json.dumps(card, indent=1))
    out = demo / "MODEL_CARD.md"
    out.write_text(render(card))
    return out


def heldout_key(head: str) -> str:
    return "heldout" if head == "eagle" else f"heldout_{head}"
