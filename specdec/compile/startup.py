"""Whether a model's forwards run compiled, decided at start-up
(``--compile``): build or load the graphs (``specdec.compile.forwards``), check them
against the eager forward, time them against it under ``auto``, and fall
back to eager forwards per model with one log line saying why."""

from __future__ import annotations

import functools
import logging
import time

import torch

from specdec.compile.eager import eager_forward, eager_run
from specdec.compile.forwards import (ALIBI_REASON, CAPTURED, MIN_CAPACITY, PAYS, PREFILL_CAPACITIES, PREFILL_WIDTH,
                                      READY_WIDTHS, STARTUP_WIDTHS, CompiledForward)
from specdec.model import kv
from specdec.model.causal_lm import CausalLm
from specdec.model.loading import COMPILE_MODES
from specdec.model.quantize import compute_dtype

log = logging.getLogger(__name__)

# The tree the start-up check verifies: a default tree's width (READY_WIDTHS,
# opened before readiness anyway: the check opens no graph of its own; a warm
# start with an EAGLE-3 head 1.18 -> 1.02 s, EAGLE-2 0.85 -> 0.83 s), branching
# at several depths.
CHECK_PARENTS = (-1, 0, 0, 1, 1, 2, 3, 3, 4, 5, 6, 7, 9, 10, 12, 13)


@torch.inference_mode()
def check_compiled(compiled: CompiledForward, layers: tuple[int, ...] = ()) -> str | None:
    """Why the compiled forward cannot serve this model (None: it can): after
    an eager prefix, a one-token step and a tree of ``CHECK_TREE`` nodes (the
    widths opened before readiness anyway: the check opens no other graph)
    must give the eager logits (and the streams entering ``layers``) and
    leave the cache as long."""
    lm = compiled.lm
    vocab = int(lm.config.get_text_config(decoder=True).vocab_size)
    n = len(CHECK_PARENTS)
    seq = torch.randint(0, vocab, (5 + n,), generator=torch.Generator().manual_seed(0))
    ancestor = torch.eye(n, dtype=torch.bool)        # [n, n] a node sees itself and its ancestors
    depth = [0] * n
    for i, parent in enumerate(CHECK_PARENTS[1:], 1):
        ancestor[i] |= ancestor[parent]
        depth[i] = depth[parent] + 1
    tree_pos = 5 + torch.tensor(depth)
    tree = seq[5:]
    k_pos = torch.cat([torch.arange(5), tree_pos])[None]
    allowed = torch.cat([torch.ones(n, 5, dtype=torch.bool), ancestor], dim=1)[None]
    outputs = {}
    for run, step in (("compiled", compiled.run), ("eager", functools.partial(eager_run, lm))):
        cache = compiled.new_cache(5 + n)
        lm.hidden(cache, seq[None, :4], torch.arange(4)[None], None)
        one = step(cache, seq[None, 4:5], torch.tensor([[4]]), None, layers)
        if one is None:
            return "a one-token step does not take the compiled path"
        tree_out = step(cache, tree[None], tree_pos[None], lm.masks(allowed, tree_pos[None], k_pos), layers)
        if kv.seq_len(cache) != 5 + n:
            return f"the {run} path left {kv.seq_len(cache)} cached slots, not {5 + n}"
        outputs[run] = {f"{what} {name}": t for what, out in (("step", one), ("tree", tree_out))
                        for name, t in (("streams", out[1]), ("logits", out[2])) if t is not None}
    fp32 = compute_dtype(lm.model, lm.dtype) == torch.float32     # (quantized linears multiply in bf16)
    for name, want in outputs["eager"].items():
        got = outputs["compiled"][name]
        err = float((got - want).abs().max() / (1.0 + want.abs().max()))
        if not err <= (1e-4 if fp32 else 5e-2):
            return f"compiled {name} differ from eager ones (relative error {err:.2g})"
    return None


@torch.inference_mode()
def time_step(lm: CausalLm, step, cache, prefix: int = 64, repeats: int = 20) -> float:
    """Median ms of ``step`` on one token after an eager ``prefix`` (cut back after each run)."""
    lm.hidden(cache, torch.zeros(1, prefix, dtype=torch.long), torch.arange(prefix)[None], None)
    times, cuda = [], torch.device(lm.device).type == "cuda"
    for _ in range(repeats + 2):
        t = time.perf_counter()
        step(cache, torch.zeros(1, 1, dtype=torch.long), torch.tensor([[prefix]]), None)
        if cuda:                         # a GPU step has only been launched when the call returns
            torch.cuda.synchronize(lm.device)
        times.append(time.perf_counter() - t)
        kv.truncate(cache, prefix)
    return sorted(times[2:])[repeats // 2] * 1000


def compile_target(lm: CausalLm, mode: str, captures: bool = False) -> CompiledForward | None:
    """The compiled forward of ``lm`` for ``--compile MODE``, or None (eager):
    off; compilation or the check failed (one log line says why); or, with
    auto, a compiled one-token step is not faster than the eager one. With
    ``captures``, the graphs that return feature layers too (``compile_captures``)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"--compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    if mode == "off":
        return None
    kind = getattr(lm.config, "model_type", "?")
    t = time.perf_counter()
    try:
        compiled = CompiledForward(lm)
        reason = check_compiled(compiled) if lm.alibi is None else ALIBI_REASON
        if reason is None:
            # a verifier started for EAGLE-3 heads verifies their trees with the capturing set:
            # of the plain one, only a root-only cycle's (plain decoding) before readiness
            compiled.warm(STARTUP_WIDTHS, ready=READY_WIDTHS[:1] if captures else READY_WIDTHS)
            compiled.warm((PREFILL_WIDTH,), PREFILL_CAPACITIES, ready=())
    except Exception as exc:  # noqa: BLE001 - any failure means: run this model eagerly
        reason = f"compilation failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    if reason is not None:
        log.warning("compiled forwards off for model type %r: %s; running eagerly", kind, reason)
        return None
    if mode == "auto":
        eager_ms = time_step(lm, functools.partial(eager_forward, lm), compiled.new_cache(MIN_CAPACITY))
        compiled_ms = time_step(lm, compiled.forward, compiled.new_cache(MIN_CAPACITY))
        if compiled_ms > PAYS * eager_ms:
            log.warning("compiled forwards off for model type %r: a one-token step takes %.2f ms compiled, "
                        "%.2f ms eager (auto keeps it below %.0f%%)", kind, compiled_ms, eager_ms, PAYS * 100)
            return None
    kept = "packed" if compiled.packed else "shared"
    log.info("compiled forwards on for model type %r (%.1f s to build or load widths %s and check; %s weights "
             "in the ahead-of-time packages)", kind, time.perf_counter() - t, ",".join(map(str, STARTUP_WIDTHS)), kept)
    if captures:
        compile_captures(compiled)
    return compiled


def compile_captures(compiled: CompiledForward, widths: tuple[int, ...] | None = None) -> bool:
    """Add the graphs that also return the residual streams EAGLE-3 drafters
    read (``CompiledForward.capture_layers``), checked against eager and
    warmed at ``widths`` (None: ``STARTUP_WIDTHS``, opened now at
    ``READY_WIDTHS``, the rest left to ``open_next``); False, with one log line,
    where that fails (sessions asking for layers then run eagerly)."""
    if compiled.capturing is not None:
        return True
    kind = getattr(compiled.lm.config, "model_type", "?")
    t = time.perf_counter()
    try:
        compiled.capture_layers()
        layers = tuple(sorted({0, compiled.layers // 2, compiled.layers - 1}))[:CAPTURED]
        reason = check_compiled(compiled, layers)
        if reason is None:
            compiled.warm(STARTUP_WIDTHS if widths is None else widths, captures=True,
                          ready=READY_WIDTHS if widths is None else None)
            compiled.warm((PREFILL_WIDTH,), PREFILL_CAPACITIES, captures=True, ready=())
    except Exception as exc:  # noqa: BLE001 - any failure means: those sessions run eagerly
        reason = f"compilation failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    if reason is not None:
        compiled.capturing = None
        log.warning("compiled forwards returning feature layers off for model type %r: %s; sessions that ask "
                    "for layers (EAGLE-3 drafters) run eagerly", kind, reason)
        return False
    log.info("compiled forwards returning up to %d feature layers on for model type %r (%.1f s)", CAPTURED, kind,
             time.perf_counter() - t)
    return True
