"""``specdec bench profile``: where the time of one step goes, eager and compiled.

    specdec bench profile --json prof.json                       # eager steps, dispatch share
    specdec bench profile --compile on --e2e-prompts 4 --startup --json prof.json

Steps timed (median of ``--steps`` runs after two warm-ups, the caches cut
back after each run so every run sees the same ``--prefix`` cached tokens):

- ``target_step``: the target's one-token step (plain decoding's whole cycle);
- ``target_verify16``: a 16-node tree verify with its ancestor mask;
- ``eagle_level8``: one EAGLE head level over an 8-node frontier, lm_head and
  log-softmax included (``drafter.eagle.eagle2.EagleDrafter.step``; compiled:
  ``drafter.compiled.head_levels``).

For each eager step, ``torch.profiler`` counts the aten operators dispatched
and the self time of the compute kernels (matrix products and the attention
kernel, ``COMPUTE_OPS``); ``dispatch_share`` = 1 - kernel time / wall time of
the same profiled runs (the profiler's own cost per operator counts as dispatch):
the share spent dispatching operators, in Python and in the small
element-wise kernels that a fused graph removes. With ``--compile on|auto``
the target steps are also timed through ``specdec.compile.forwards`` (alone, and
interleaved run by run with the eager path and a ``torch.compile``-only path
without the ahead-of-time packages: ``interleaved``), and
``--e2e-prompts N`` decodes N bundled prompts with vanilla and eagle2 on the
eager and the compiled verifier side by side (interleaved, as ``specdec
bench`` does). ``--startup`` times the start-up (load, compile and check of
the target and the EAGLE drafter; for an EAGLE-3 head, the target's forwards
returning feature layers too, as a verifier started for it builds them) in
fresh processes: eager, compiled with an empty inductor cache (cold) and
compiled again with that cache (warm: TORCHINDUCTOR_CACHE_DIR).
The one-token steps are also set against the memory floor of the target's
weights at the bandwidth measured in the run (``specdec.bench.roofline``).
``--batches`` and ``--prefill`` time batched verification and prefill on the
eager and the compiled paths (``specdec.bench.batch_profile``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from specdec.bench import batch_profile, roofline
from specdec.bench.batch_profile import sync
from specdec.bench.runner import LocalMethod, Prompt, device_name, measure, summarize
from specdec.compile.forwards import MIN_CAPACITY, WIDTHS, CompiledForward, width_bucket
from specdec.compile.startup import compile_target
from specdec.model import kv
from specdec.model.loading import ModelSpec, load_tokenizer
from specdec.procs import feature_layer_flags
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from specdec.tree.layout import tree_from_lists
from drafter.base import DraftSession
from drafter.eagle.eagle2 import EagleDrafter
from drafter.eagle.eagle3 import load_eagle_drafter
from verifier.engine import TargetModel, VerifierEngine

COMPUTE_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
               "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu")     # (--weights int8|int4)
VERIFY_NODES, FRONTIER = 16, 8
PROMPTS = Path(__file__).resolve().parent / "prompts.jsonl"


@dataclass(frozen=True)
class StepTimes:
    wall_ms: float                      # median, unprofiled
    ops: float | None = None            # aten operators dispatched per step (nested calls included)
    kernel_ms: float | None = None      # self time of COMPUTE_OPS per step, under the profiler
    profiled_ms: float | None = None    # wall time per step under the profiler

    def record(self) -> dict:
        share = None if self.kernel_ms is None else max(0.0, 1.0 - self.kernel_ms / self.profiled_ms)
        return {"wall_ms": round(self.wall_ms, 3), "aten_ops": None if self.ops is None else round(self.ops),
                "kernel_ms": None if self.kernel_ms is None else round(self.kernel_ms, 3),
                "profiled_ms": None if self.profiled_ms is None else round(self.profiled_ms, 3),
                "dispatch_share": None if share is None else round(share, 3)}


@torch.inference_mode()
def time_step(run, reset, steps: int, profile: bool) -> StepTimes:
    """Median wall ms of ``run()`` (``reset()`` after each), and its operator profile."""
    times = []
    for i in range(steps + 2):
        t = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t)
        reset()
    wall = sorted(times[2:])[steps // 2] * 1000
    if not profile:
        return StepTimes(wall)
    runs, spent = min(steps, 10), 0.0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(runs):
            t = time.perf_counter()
            run()
            sync()
            spent += time.perf_counter() - t
            reset()
    events = prof.key_averages()
    reset_ops = _reset_ops(reset)
    ops = sum(e.count for e in events if e.key.startswith("aten::")) / runs - reset_ops
    kernel = sum(e.self_cpu_time_total for e in events if e.key in COMPUTE_OPS) / runs / 1000
    return StepTimes(wall, ops, kernel, spent / runs * 1000)


def _reset_ops(reset) -> float:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        reset()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


class StepBench:
    """The three steps of a cycle on a target (eager, and compiled when given) and an EAGLE head."""

    def __init__(self, target: TargetModel, drafter, prefix: int):
        self.target, self.drafter, self.prefix = target, drafter, prefix
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, target.vocab_size, (prefix + VERIFY_NODES,), generator=gen)
        parents = [-1] + [(i - 1) // 2 for i in range(1, VERIFY_NODES)]        # a binary tree, depth 3
        self.tree = tree_from_lists(self.ids[prefix:].tolist(), parents)

    def target_runs(self, forward, new_cache):
        """(one-token step, 16-node verify, reset) on a fresh cache holding the prefix."""
        cache, p = new_cache(self.prefix + 2 * VERIFY_NODES), self.prefix
        with torch.inference_mode():
            self.target.lm.hidden(cache, self.ids[None, :p], torch.arange(p)[None], None)
        one = partial(forward, cache, self.ids[None, p:p + 1], torch.tensor([[p]]), None)
        mask = self.target.tree_masks(self.tree, p)
        verify = partial(forward, cache, self.tree.tokens[None], self.tree.position_ids(p)[None], mask)
        return one, verify, partial(kv.truncate, cache, p)

    def target_steps(self, forward, new_cache, steps: int, profile: bool) -> dict[str, StepTimes]:
        one, verify, reset = self.target_runs(forward, new_cache)
        return {"target_step": time_step(one, reset, steps, profile),
                "target_verify16": time_step(verify, reset, steps, profile)}

    @torch.inference_mode()
    def interleaved(self, paths: dict, steps: int) -> dict[str, dict[str, float]]:
        """Median wall ms of the target steps on each of ``paths`` (name -> (forward,
        new_cache)), alternating the paths run by run so that load shifts hit all alike."""
        runs = {name: self.target_runs(*path) for name, path in paths.items()}
        times = {name: {"target_step": [], "target_verify16": []} for name in paths}
        for _ in range(steps + 2):
            for key, which in (("target_step", 0), ("target_verify16", 1)):
                for name, run in runs.items():
                    t = time.perf_counter()
                    run[which]()
                    sync()
                    times[name][key].append(time.perf_counter() - t)
                    run[2]()
        return {name: {key: round(sorted(ts[2:])[steps // 2] * 1000, 3) for key, ts in by_step.items()}
                for name, by_step in times.items()}

    def eagle_level(self, steps: int, profile: bool) -> StepTimes:
        d, p = self.drafter, self.prefix
        sess = DraftSession(tokens=[0], cache=d.new_cache())
        feats = torch.randn(1, p, d.hidden_size, generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            d.head(d.embed_tokens(self.ids[None, :p]), feats, torch.arange(p)[None], None, sess.cache)
        tokens = self.ids[p:p + FRONTIER]
        parent = torch.randn(FRONTIER, d.hidden_size, generator=torch.Generator().manual_seed(2))
        positions = torch.full((FRONTIER,), p)
        allowed = torch.cat([torch.ones(FRONTIER, p, dtype=torch.bool), torch.eye(FRONTIER, dtype=torch.bool)], 1)
        key_pos = torch.cat([torch.arange(p), positions])
        level = partial(d.step, sess, tokens, parent, positions, allowed, key_pos)
        return time_step(level, partial(kv.truncate, sess.cache, p), steps, profile)


def end_to_end(target_dir: str, eagle_dir: str, eager: TargetModel, fast: TargetModel | None, drafters: tuple,
               n_prompts: int, max_new_tokens: int, tree: TreeParams) -> dict:
    """vanilla and eagle2 on the eager (and compiled) verifier and drafter
    (``drafters``: eager, compiled), interleaved per prompt."""
    tok = load_tokenizer(target_dir)
    texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()][:n_prompts]
    prompts = [Prompt(t, tok(t)["input_ids"]) for t in texts]
    stop = StopCriteria(max_new_tokens=max_new_tokens, eos_ids=frozenset())
    params, methods = SamplingParams(), {}
    for suffix, target, drafter in (("", eager, drafters[0]), ("+compiled", fast, drafters[1])):
        if target is not None:
            engine = VerifierEngine(target)
            methods["vanilla" + suffix] = LocalMethod(engine, None, None, params, stop)
            methods["eagle2" + suffix] = LocalMethod(engine, drafter, tree, params, stop)
    return summarize(measure(methods, prompts), greedy=True)


def startup_seconds(args, mode: str, cache_dir: str) -> float:
    """Seconds a fresh process takes to load the target and the EAGLE drafter with ``--compile mode``."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "specdec.cli.main", "bench", "profile", "--startup-only", "--compile", mode,
               "--target", args.target_dir, "--eagle", args.eagle_dir, "--json", out.name]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())["startup_s"]


def run_profile(args, target_dir: str, eagle_dir: str | None) -> dict:
    """The profile record; ``eagle_dir`` None: the target's steps only (a target with no head yet)."""
    args.target_dir, args.eagle_dir = target_dir, eagle_dir
    spec = ModelSpec(path=target_dir, dtype=args.dtype, device=args.device, weights=args.weights)
    if args.startup_only:
        # as the services start: for an EAGLE-3 head the verifier also builds the forwards
        # returning feature layers (``--compile-feature-layers``, ``specdec.procs``)
        layers = bool(feature_layer_flags(eagle_dir, args.compile))
        t = time.perf_counter()
        TargetModel(ModelSpec(path=target_dir, dtype=args.dtype, device=args.device, compile=args.compile,
                              compile_layers=layers, weights=args.weights))
        target_s = time.perf_counter() - t
        load_eagle_drafter(eagle_dir, target_dir, device=args.device, compile=args.compile, weights=args.weights)
        total = time.perf_counter() - t
        return {"startup_s": round(total, 3), "target_s": round(target_s, 3), "drafter_s": round(total - target_s, 3),
                "feature_layers": layers}
    eager = TargetModel(spec)
    drafter = None if eagle_dir is None else EagleDrafter(eagle_dir, target_dir, device=args.device)
    bench = StepBench(eager, drafter, args.prefix)
    result = {"device": device_name(args.device), "target": target_dir, "prefix": args.prefix,
              "steps": {}, "compile": args.compile}
    eager_steps = bench.target_steps(eager.forward_batch, eager.lm.new_cache, args.steps, profile=True)
    if drafter is not None:
        eager_steps["eagle_level8"] = bench.eagle_level(args.steps, profile=True)
    result["steps"]["eager"] = {k: v.record() for k, v in eager_steps.items()}
    fast, fast_drafter = None, None
    if args.compile != "off":
        fast = TargetModel(spec, model=eager.model)
        t = time.perf_counter()
        fast.compiled = compile_target(fast.lm, args.compile)
        result["compile_and_check_s"] = round(time.perf_counter() - t, 3)
        if fast.compiled is not None:
            t = time.perf_counter()             # every width a tree of up to 16 nodes pads to
            fast.compiled.warm(tuple(w for w in WIDTHS if w <= width_bucket(max(VERIFY_NODES, args.total_tokens))))
            fast.compiled.open_all()            # none left to open on first use while steps are timed
            result["compile_widths_s"] = round(time.perf_counter() - t, 3)
            steps = bench.target_steps(fast.forward_batch, fast.new_cache, args.steps, profile=False)
            t = time.perf_counter()
            if eagle_dir is not None:
                fast_drafter = EagleDrafter(eagle_dir, target_dir, device=args.device, compile=args.compile)
                result["drafter_compile_and_check_s"] = round(time.perf_counter() - t, 3)
            if fast_drafter is not None and fast_drafter.compiled is not None:
                steps["eagle_level8"] = StepBench(fast, fast_drafter, args.prefix).eagle_level(args.steps, False)
            result["steps"]["compiled"] = {k: v.record() for k, v in steps.items()}
            traced = CompiledForward(fast.lm, ahead_of_time=False)      # torch.compile graphs, no packages
            traced.warm((1, width_bucket(VERIFY_NODES)), (MIN_CAPACITY,))   # the capacity the steps run at
            paths = {"eager": (eager.forward_batch, eager.lm.new_cache),
                     "torch.compile": (traced.forward, traced.new_cache),
                     "compiled": (fast.forward_batch, fast.new_cache)}
            result["interleaved"] = bench.interleaved(paths, 4 * args.steps)
            if args.batches and fast.compile_batches():
                fast.compiled.open_all()
                result["batched_verify"] = batch_profile.batched_verify(eager, fast, args.batches, args.prefix,
                                                                        args.steps)
            if args.prefill:
                result["prefill"] = batch_profile.prefill(eager, fast, args.prefill, args.steps)
        else:
            fast = None
    # the one-token steps against the memory floor of the weights (``specdec.bench.roofline``)
    if "interleaved" in result:                 # the medians of the paths timed run by run
        one_token = {path: t["target_step"] for path, t in result["interleaved"].items()}
    else:
        one_token = {path: steps["target_step"]["wall_ms"] for path, steps in result["steps"].items()}
    result["roofline"] = roofline.roofline(eager.model, one_token)
    if args.e2e_prompts:
        tree = TreeParams(total_tokens=args.total_tokens, depth=args.depth, expand_k=args.expand_k)
        result["end_to_end"] = end_to_end(target_dir, eagle_dir, eager, fast, (drafter, fast_drafter),
                                          args.e2e_prompts, args.max_new_tokens, tree)
        result["end_to_end_tree"] = {"total_tokens": tree.total_tokens, "depth": tree.depth,
                                     "expand_k": tree.expand_k, "max_new_tokens": args.max_new_tokens}
    if args.startup:
        with tempfile.TemporaryDirectory() as cache_dir:
            result["startup_s"] = {"eager": startup_seconds(args, "off", cache_dir),
                                   "compiled_cold": startup_seconds(args, "on", cache_dir),
                                   "compiled_warm": startup_seconds(args, "on", cache_dir)}
    return result


def profile_markdown(result: dict) -> str:
    if "steps" not in result:
        layers = " with the forwards returning feature layers (EAGLE-3 head)" if result.get("feature_layers") else ""
        return (f"start-up: {result['startup_s']} s (target {result['target_s']} s{layers}, "
                f"EAGLE drafter {result['drafter_s']} s)")
    target = f"- target: `{result['target']}`, {result['prefix']} cached tokens before each step"
    lines = ["# specdec bench profile", "", f"- device: {result['device']}", target, "",
             "| path | step | wall ms | aten ops | compute-kernel ms | profiled ms | dispatch share |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for path, steps in result["steps"].items():
        for name, s in steps.items():
            share = None if s["dispatch_share"] is None else f"{s['dispatch_share']:.0%}"
            cells = ["–" if c is None else str(c) for c in (s["aten_ops"], s["kernel_ms"], s["profiled_ms"], share)]
            lines.append(f"| {path} | {name} | {s['wall_ms']:.2f} | " + " | ".join(cells) + " |")
    if "end_to_end" in result:
        lines += ["", "| method | tokens/s | speedup vs vanilla | τ | matches vanilla |", "|---|---:|---:|---:|:---:|"]
        for name, m in result["end_to_end"].items():
            tau = "–" if m["tau"] is None else f"{m['tau']:.2f}"
            lines.append(f"| {name} | {m['tokens_per_s']:.1f} | {m['speedup_vs_vanilla']:.2f}x | {tau} "
                         f"| {m['matches_vanilla']} |")
    if "interleaved" in result:
        lines += ["", "| path (interleaved) | target_step ms | target_verify16 ms |", "|---|---:|---:|"]
        for name, t in result["interleaved"].items():
            lines.append(f"| {name} | {t['target_step']:.2f} | {t['target_verify16']:.2f} |")
    if "roofline" in result:
        lines += roofline.markdown(result["roofline"])
    lines += batch_profile.markdown(result)
    for key in ("compile_and_check_s", "compile_widths_s", "drafter_compile_and_check_s", "startup_s"):
        if key in result:
            lines.append(f"- {key}: {result[key]}")
    return "\n".join(lines)
