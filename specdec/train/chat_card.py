"""Model card of an EAGLE head trained from conversations: measured, never typed in.

``specdec train chat-card --target T --eagle HEAD --prompts HELDOUT.jsonl``
decodes held-out chat prompts (rendered with the target's template) greedily
twice, plainly and with EAGLE-2 dynamic trees drafted by the head, and writes
beside the head (``--out``, default its parent directory):

- ``card.json``: the target (its file and digest, how it was fetched), the
  head's training summary (``training_log.json``, written by ``specdec train
  eagle --chat``), its value temperature (``calibration.json``), per tree
  budget the held-out tau (committed tokens per target forward, 1.0 = no
  speculation), and whether every speculative output equals the plain one
  token for token (the lossless promise, in the dtype measured);
- ``calibration.png``: acceptance against the draft's confidence (EAGLE-2 §3.2);
- ``MODEL_CARD.md``: the above as a page.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from pathlib import Path

from specdec.bench.runner import device_name
from specdec.model.pypi_models import FETCHED
from specdec.request.params import TreeParams
from specdec.train.card import format_figure, tree_name

# the trees measured: the default 16 nodes (root included), a wider one of the same budget (a head whose
# first guess is right about half the time gains more from breadth than from depth: SmolLM2's first bundled
# head measured τ 2.397 at depth 10 against 2.389 at the default depth 6, its second 2.581 at depth 5 and 8
# per expansion against 2.520), and a larger budget
CHAT_TREES = (TreeParams(), TreeParams(total_tokens=16, depth=5, expand_k=8),
              TreeParams(total_tokens=32, depth=6, expand_k=6))


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def target_record(reference: str, model_dir: str) -> dict:
    """Where the target came from: the flag as given, the converted directory,
    and for a GGUF source its file name, size and sha256 (and the package that
    shipped it, when fetched from one)."""
    from specdec.model.gguf_import import source_of

    record = {"reference": reference, "directory": str(model_dir)}
    source = source_of(model_dir)
    if source is not None and Path(source).is_file():
        record |= {"file": Path(source).name, "bytes": Path(source).stat().st_size, "sha256": _digest(Path(source))}
        fetched = Path(source).parent / FETCHED
        if fetched.is_file():
            record["fetched"] = json.loads(fetched.read_text())
    return record


def read_prompts(path: Path, n: int) -> list[list[dict]]:
    """The first ``n`` chats of a JSONL file of ``{"messages": [...]}`` (checked
    as training data is, ``specdec.train.chat.read_chats``), each up to its last
    user turn (an answer given there is dropped: the target writes it)."""
    from specdec.train.chat import read_chats

    chats = []
    for messages in read_chats(path, need_assistant=False):
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        if last_user >= 0:
            chats.append(messages[:last_user + 1])
        if len(chats) == n:
            break
    if not chats:
        raise ValueError(f"no chat prompt (a line with a user turn) in {path}")
    return chats


def measure(target_dir: str, head_dir: str, chats: list[list[dict]], max_new_tokens: int,
            dtype: str = "float32", trees=CHAT_TREES) -> dict:
    """Held-out tau per tree budget, greedy identity to plain decoding, and the
    calibration points of the default budget's trees."""
    from specdec.bench.calibration import TreeRecorder, calibration_bins
    from specdec.local import DrafterChoice, build_local, generate
    from specdec.model.loading import ModelSpec
    from specdec.model.prompts import prompt_ids
    from specdec.request.decoding import StopCriteria
    from specdec.request.params import SamplingParams

    stack = build_local(ModelSpec(target_dir, dtype=dtype), DrafterChoice("eagle", head_dir))
    eos = stack.tokenizer.eos_token_id
    stop = StopCriteria(max_new_tokens=max_new_tokens, eos_ids=frozenset() if eos is None else frozenset([int(eos)]))
    prompts = [prompt_ids(stack.tokenizer, chat) for chat in chats]
    plain = [generate(stack.verifier, None, p, SamplingParams(), stop, None).tokens for p in prompts]
    runs, recorder = {}, TreeRecorder(stack.verifier)
    for k, cfg in enumerate(trees):
        engine = recorder if k == 0 else stack.verifier          # calibration: the default budget's trees
        committed = cycles = same = 0
        t0 = time.perf_counter()
        for p, want in zip(prompts, plain):
            dec = generate(engine, stack.drafter, p, SamplingParams(), stop, cfg)
            committed += sum(dec.stats.committed_per_cycle)
            cycles += dec.stats.cycles
            same += dec.tokens == want
        runs[tree_name(cfg)] = {"tau": round(committed / max(cycles, 1), 3), "identical": same,
                                "tokens": committed, "seconds": round(time.perf_counter() - t0, 1)}
    return {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "dtype": dtype,
            "plain_tokens": sum(len(t) for t in plain), "trees": runs,
            "calibration": calibration_bins(recorder.points())}


def collect(reference: str, target_dir: str, head_dir: Path, prompts_file: Path, n: int, max_new_tokens: int,
            dtype: str) -> dict:
    head_dir = Path(head_dir)
    training = json.loads((head_dir / "training_log.json").read_text()) if (head_dir / "training_log.json").is_file() \
        else {}
    value_t = json.loads((head_dir / "calibration.json").read_text()) if (head_dir / "calibration.json").is_file() \
        else {}
    chats = read_prompts(prompts_file, n)
    return {"target": target_record(reference, target_dir), "head": str(head_dir),
            "head_config": json.loads((head_dir / "config.json").read_text()),
            "training": {k: v for k, v in training.items() if k not in ("history_tail", "evals", "target")},
            "last_eval": (training.get("evals") or [None])[-1], "value_temperature": value_t,
            "heldout_prompts": str(prompts_file),
            "heldout": measure(target_dir, str(head_dir), chats, max_new_tokens, dtype),
            "machine": {"platform": platform.platform(), "processor": device_name("cpu")}}


def render(card: dict) -> str:
    t, tr, h = card["target"], card["training"], card["heldout"]
    cfg = card["head_config"]
    version = 3 if "draft_vocab_size" in cfg else 2
    lines = [f"# EAGLE-{version} head for {Path(t.get('file') or t['reference']).stem}", "",
             "Trained here by `specdec train eagle --chat` on the target's own conversations; every number below "
             "was measured by `specdec train chat-card` (which wrote this file).", "",
             "## Target", "",
             f"- given as `{t['reference']}`" + (f": `{t['file']}`, {t['bytes']:,} bytes, sha256 `{t['sha256']}`"
                                                  if "file" in t else ""),
             ]
    if "fetched" in t:
        f = t["fetched"]
        lines.append(f"- from the PyPI package `{f.get('package')}` (wheel `{f.get('wheel', '')}`), fetched without "
                     "its dependencies")
    lines += ["", "## Training", "",
              f"- conversations: {tr.get('chat_train', 'n/a')} for training, {tr.get('chat_heldout', 'n/a')} held "
              f"out; assistant turns regenerated by the training run itself (`--regenerate`): "
              f"{'yes' if tr.get('regenerated') else 'no'}",
              f"- {tr.get('config', {}).get('steps', 'n/a')} steps of {tr.get('config', {}).get('batch', 'n/a')} "
              f"conversations (at most {tr.get('config', {}).get('seq_len', 'n/a')} tokens each), precision "
              f"{tr.get('precision', 'fp32')}, {format_figure(tr.get('train_seconds'), '.0f')} s of training",
              f"- head: {cfg.get('num_hidden_layers', 1)} decoder layer, hidden {cfg.get('hidden_size')}, draft "
              f"vocabulary {tr.get('draft_vocab', cfg.get('draft_vocab_size'))} tokens (covering "
              f"{format_figure(tr.get('draft_vocab_assistant_coverage'))} of the assistant tokens), feature layers "
              f"{tr.get('feature_layers')}, {tr.get('ttt_steps')} training-time-test steps",
              f"- last held-out eval: `{json.dumps(card.get('last_eval'))}`",
              f"- greedy value temperature: {format_figure(card['value_temperature'].get('greedy_value_temperature'))}",
              "", "## Held-out acceptance", "",
              f"{h['prompts']} held-out chat prompts (`{Path(card['heldout_prompts']).name}`), greedy, up to "
              f"{h['max_new_tokens']} new tokens, target in {h['dtype']} on {card['machine']['processor']}. "
              "tau = committed tokens per target forward (1.0: no speculation).", "",
              "| tree | tau | outputs identical to plain decoding |", "|---|---|---|"]
    for name, run in h["trees"].items():
        lines.append(f"| {name} | {run['tau']:.3f} | {run['identical']} of {h['prompts']} |")
    lines += ["", "## Calibration (default tree)", "", "![calibration](calibration.png)", "",
              "| draft confidence | nodes | accepted |", "|---|---|---|"]
    for b in h["calibration"]:
        if b["nodes"]:
            lines.append(f"| {b['lo']:.2f}–{b['hi']:.2f} | {b['nodes']} | {format_figure(b['rate'])} |")
    return "\n".join(lines) + "\n"


def write_chat_card(reference: str, target_dir: str, head_dir: Path, prompts_file: Path, out: Path, n: int = 24,
                    max_new_tokens: int = 96, dtype: str = "float32") -> Path:
    from specdec.bench.report import plot_calibration

    card = collect(reference, target_dir, head_dir, prompts_file, n, max_new_tokens, dtype)
    out.mkdir(parents=True, exist_ok=True)
    bins = card["heldout"]["calibration"]
    plot_calibration({"bins": bins, "method": "eagle2 trees, held-out chats",
                      "evaluated_nodes": sum(b["nodes"] for b in bins)}, out / "calibration.png")
    (out / "card.json").write_text(json.dumps(card, indent=1))
    (out / "MODEL_CARD.md").write_text(render(card))
    return out / "MODEL_CARD.md"
