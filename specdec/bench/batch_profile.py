"""``specdec bench profile --compile on --batches 2,4,8 --prefill 96,192,400``:
batched verification and prefill, eager and compiled, interleaved run by run
in one process (so load shifts of a shared machine hit every path alike).

- batched verification: B sessions of ``--prefix`` cached tokens each verify
  one tree each in one ``VerifierEngine.verify_batch`` call, root-only trees
  (a batch of plain decoding) and 16-node trees, on three paths: ``eager``
  (one eager batched forward), ``compiled rows`` (the one-session compiled
  graphs, row by row: what a batch no batched graph serves runs) and
  ``compiled batched`` (one forward of the batched graphs,
  ``specdec.compile.batched``); every session is rolled back after each run;
- prefill: a prompt of N tokens on a fresh cache, eager (one causal forward)
  and compiled (``CompiledForward.prefill``: 64-token chunks).

Median wall ms of ``--steps`` runs after two warm-ups.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import torch

from specdec.request.params import SamplingParams
from specdec.tree.layout import tree_from_lists
from verifier.engine import TargetModel, VerifierEngine

TREE_NODES = 16


@contextmanager
def rows_only(target: TargetModel):
    """The target's batches run row by row while inside (its batched graphs set aside)."""
    batched, target.compiled.batched = target.compiled.batched, {}
    try:
        yield
    finally:
        target.compiled.batched = batched


def _median_ms(times: list[float], steps: int) -> float:
    return round(sorted(times[2:])[steps // 2] * 1000, 3)


def _sessions(engine: VerifierEngine, rows: int, prefix: int, vocab: int) -> list[str]:
    gen = torch.Generator().manual_seed(rows)
    sids = [f"profile-{rows}-{b}" for b in range(rows)]
    for sid in sids:
        engine.prefill(sid, torch.randint(0, vocab, (prefix,), generator=gen).tolist(), SamplingParams())
    return sids


def _trees(engine: VerifierEngine, sids: list[str], nodes: int, vocab: int):
    gen = torch.Generator().manual_seed(nodes)
    parents = [-1] + [(i - 1) // 2 for i in range(1, nodes)]           # a binary tree
    return [(sid, tree_from_lists([engine.committed_tokens(sid)[-1]]
                                  + torch.randint(0, vocab, (nodes - 1,), generator=gen).tolist(), parents))
            for sid in sids]


def batched_verify(eager: TargetModel, fast: TargetModel, batches: tuple[int, ...], prefix: int,
                   steps: int) -> dict[str, dict[str, dict[str, float]]]:
    """{"B=b": {"root-only" | "tree16": {path: median ms of one batched verify}}}."""
    vocab = eager.vocab_size
    engines = {"eager": VerifierEngine(eager), "compiled": VerifierEngine(fast)}
    out = {}
    for rows in batches:
        sids = {name: _sessions(engine, rows, prefix, vocab) for name, engine in engines.items()}
        out[f"B={rows}"] = {}
        for label, nodes in (("root-only", 1), (f"tree{TREE_NODES}", TREE_NODES)):
            times = {"eager": [], "compiled rows": [], "compiled batched": []}
            for _ in range(steps + 2):
                for path, taken in times.items():
                    engine = engines["eager" if path == "eager" else "compiled"]
                    ids = sids["eager" if path == "eager" else "compiled"]
                    items = _trees(engine, ids, nodes, vocab)
                    with rows_only(fast) if path == "compiled rows" else nullcontext():
                        t = time.perf_counter()
                        engine.verify_batch(items)
                        taken.append(time.perf_counter() - t)
                    for sid in ids:
                        engine.rollback(sid, prefix + 1)
            out[f"B={rows}"][label] = {path: _median_ms(ts, steps) for path, ts in times.items()}
        for name, engine in engines.items():
            for sid in sids[name]:
                engine.release(sid)
    return out


def sync() -> None:
    """Wait for the GPU's queued work, if a GPU is in use: a CUDA forward returns once launched."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


@torch.inference_mode()
def prefill(eager: TargetModel, fast: TargetModel, lengths: tuple[int, ...], steps: int) -> dict[str, dict]:
    """{"N tokens": {"eager" | "compiled": median ms of a prefill on a fresh cache}}; over int8
    weights also "int8 kernel": the compiled target with its prompts' products left to the packed
    int8 kernel (``TargetModel.int8_prompts`` off), interleaved with the others."""
    paths = [("eager", eager, True), ("compiled", fast, True)] + ([("int8 kernel", fast, False)]
                                                                  if fast.int8_prompts else [])
    out = {}
    for n in lengths:
        ids = torch.randint(0, eager.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        times = {path: [] for path, _, _ in paths}
        for _ in range(steps + 2):
            for path, target, dense in paths:
                cache = target.new_cache(n)
                kept, target.int8_prompts = target.int8_prompts, target.int8_prompts and dense
                try:
                    t = time.perf_counter()
                    target.run(cache, ids[None], torch.arange(n)[None], None)
                    sync()
                    times[path].append(time.perf_counter() - t)
                finally:
                    target.int8_prompts = kept
        out[f"{n} tokens"] = {path: _median_ms(ts, steps) for path, ts in times.items()}
    return out


def markdown(result: dict) -> list[str]:
    lines = []
    if "batched_verify" in result:
        lines += ["", "| batch | trees | eager ms | compiled rows ms | compiled batched ms | batched ÷ rows |",
                  "|---|---|---:|---:|---:|---:|"]
        for batch, by_tree in result["batched_verify"].items():
            for label, t in by_tree.items():
                ratio = t["compiled batched"] / t["compiled rows"]
                lines.append(f"| {batch} | {label} | {t['eager']:.2f} | {t['compiled rows']:.2f} | "
                             f"{t['compiled batched']:.2f} | {ratio:.2f} |")
    if "prefill" in result:
        kernel = any("int8 kernel" in t for t in result["prefill"].values())
        lines += ["", "| prompt | eager ms | compiled ms | eager ÷ compiled |"
                  + (" int8 kernel ms | int8 kernel ÷ compiled |" if kernel else ""),
                  "|---|---:|---:|---:|" + ("---:|---:|" if kernel else "")]
        for n, t in result["prefill"].items():
            row = f"| {n} | {t['eager']:.2f} | {t['compiled']:.2f} | {t['eager'] / t['compiled']:.2f} |"
            if kernel:
                row += f" {t['int8 kernel']:.2f} | {t['int8 kernel'] / t['compiled']:.2f} |"
            lines.append(row)
    return lines
