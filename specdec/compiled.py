"""Compiled target forwards over a fixed-shape KV view (``--compile``).

An eager forward of a small model is mostly per-operator dispatch and Python
(``specdec bench profile`` measures the share). ``torch.compile`` (inductor)
removes it only if the shapes stop changing from one step to the next, so the
compiled path never lets them change, as gpt-fast does with a static cache:

- the cache: a session's in-place cache (``specdec.kv.SlabLayer``) whose
  layers are views into one stacked buffer [layers, 2, 1, heads, C, d] at a
  *capacity bucket* (a power of two >= 256 slots), zero-filled: every step
  gets the same shapes, and one K/V input instead of one per layer (each
  input is a Dynamo guard and a wrapper argument). A session starts in the
  smallest bucket and moves up (its filled slots copied once, ``fit``) when a
  forward would pass its capacity: every step attends over all C slots, so
  C follows the session's length, not the length it may grow to (a step
  over 256 slots takes ~0.8x the one over 512 on the demo target);
- the writes: the step writes its n new K/V into slots [L, L + n) of that
  buffer with one indexed write per layer (``specdec.fixed_kv``), slot indices as a
  tensor, so the length L is data, not shape; the cache length moves
  afterwards, outside;
- the mask: the forward's additive mask [1, 1, n, L + n] (tree or causal, per
  layer type for windowed models) padded to [1, 1, nb, C] with the dtype's
  minimum: slots past the length are invisible (they are zeros, never NaN);
- the width: n is padded up to the next of ``WIDTHS`` (1, 2, 4, ... 64); pad
  queries see only their own slot and their outputs are dropped.

One graph per (width, capacity) pair. At the smallest capacities
(``PACKAGED_CAPACITIES``) the graphs are
ahead-of-time compiled packages kept on disk (``specdec.compiled_aot``): a
restart loads them instead of tracing the model again, and their calls skip
Dynamo's guards and the Python wrapper. A small model's packages (weights
times ``WIDTHS`` within ``PACKED_BUDGET``) hold their own copy of the weights
packed for inductor's CPP GEMM kernels, which beat a BLAS call per linear on
these GEMV shapes; a larger model's packages run over its own parameters,
one copy for all widths. Those of a default-sized tree are
built or loaded at start-up (``STARTUP_WIDTHS``, at every packaged capacity);
those of a root-only cycle and a default tree (``READY_WIDTHS``) are opened
and run once at the first capacity before readiness, the rest by the verifier
service while no request is in flight (``open_next``: the first session to
pass 256 slots no longer pays ~180 ms for them), or on first use; larger
capacities (long sessions) use ``torch.compile`` on first use. A package's
key digests the traced code only (``specdec.fixed_step``, ``specdec.fixed_kv``),
so editing this module keeps the packages on disk.

EAGLE-3 drafters read the residual streams entering three of the target's
layers: their sessions' forwards take a second set of graphs
(``capture_layers``) that also return the streams of up to ``CAPTURED``
layers, picked by an index tensor (data, not shape: one set serves any
head). It is built only where such sessions are expected (``--compile-
feature-layers``, or an in-process EAGLE-3 drafter): returning the streams
costs ~7% of a one-token step, which EAGLE-1/2 and plain decoding do not pay.
Without it those sessions run eagerly (one log line says so).

Prefill (a causal forward of several tokens) and batched verification stay eager. A model that
fails to compile, or whose compiled logits differ from its eager ones on a
check at load, runs eagerly with one log line saying why (``compile_target``).
With ``auto`` the compiled path is also timed against the eager one on a
one-token step and kept only where it pays.

On CUDA the same code path would take ``mode="reduce-overhead"`` (CUDA graphs
over the same fixed shapes); that is not exercised on this project's machines.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable

import torch

from specdec import compiled_aot, kv
from specdec.causal_lm import CausalLm
from specdec.fixed_kv import FixedLayer, cache_shape, fixed_buffers, padded, stacked_cache
from specdec.fixed_step import FixedStep
from specdec.knobs import DEFAULT_TOTAL_TOKENS
from specdec.masks import causal_allowed
from specdec.models import COMPILE_MODES

log = logging.getLogger(__name__)

WIDTHS = (1, 2, 4, 8, 16, 32, 64)      # compiled query widths; a forward is padded up to the next one
PACKAGED_CAPACITIES = (256, 512)        # capacities with ahead-of-time packages (built at start-up)
MIN_CAPACITY = PACKAGED_CAPACITIES[0]   # capacity buckets: powers of two from here
PACKED_BUDGET = 1 << 30                 # packed weights (one copy per package) only while they fit in this
PAYS = 0.9                              # auto: compiled must take at most this share of the eager step time
# compiled at start-up: every width a default-sized tree pads to (larger trees compile on first use)
ALIBI_REASON = "ALiBi models run their own blocks with per-row biases (specdec.alibi), not one fixed-shape forward"
STARTUP_WIDTHS = tuple(w for w in WIDTHS if w <= DEFAULT_TOTAL_TOKENS)
# of those, opened and run before readiness: a root-only cycle's and a default tree's (the check at load
# opens a 3-node tree's, 4); the others open while the server is idle (``open_next``) or on first use
READY_WIDTHS = (1, next(w for w in WIDTHS if w >= DEFAULT_TOTAL_TOKENS))
CAPTURED = 3                            # residual streams a capturing graph returns (an EAGLE-3 head reads 3)


def capacity_bucket(slots: int) -> int:
    """The fixed capacity a cache reserving ``slots`` gets: a power of two >= MIN_CAPACITY."""
    c = MIN_CAPACITY
    while c < slots:
        c *= 2
    return c


def width_bucket(n: int) -> int | None:
    return next((w for w in WIDTHS if w >= n), None)


class FixedGraphs:
    """The compiled graphs of one fixed-shape step module, one per (width,
    capacity): at ``packaged_capacities`` AOTInductor packages kept on disk
    (``specdec.compiled_aot``) when ``ahead_of_time``, packed (their own copy
    of the weights, for inductor's CPP GEMM) for a small ``model`` on CPU or
    when ``packed``; at larger capacities (or without packages) ``torch.compile``."""

    def __init__(self, module: torch.nn.Module, model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                 ahead_of_time: bool = True, packed: bool | None = None, options: dict | None = None,
                 sources: tuple[str, ...] = (), packaged_capacities: tuple[int, ...] = PACKAGED_CAPACITIES,
                 variant: str = ""):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.module = module
        self.options = options
        self.traced = None                 # torch.compile of the module, made on first need (it costs ~2 s)
        sources = (*sources, inspect.getfile(FixedLayer))     # every step writes its K/V through it
        self.packages = (compiled_aot.package_dir(module, model, dtype, device, sources, variant)
                         if ahead_of_time else None)
        weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
        if packed is None:               # one packed copy of the weights per package: small models only
            packed = device.type == "cpu" and weight_bytes * len(WIDTHS) * len(packaged_capacities) <= PACKED_BUDGET
        self.packed = ahead_of_time and packed
        self.weights = compiled_aot.shared_weights(module) if ahead_of_time and not self.packed else None
        self.graphs: dict[tuple[int, int], object] = {}      # (width, capacity) -> the compiled step
        self.opening: dict[tuple[int, int], threading.Lock] = {}   # held while that graph is opened
        self.packaged_capacities = tuple(packaged_capacities)

    def on_disk(self, width: int, capacity: int, example: Callable[[], tuple]) -> bool:
        """Build the package for (width, capacity) if it is missing, without
        loading it; False where that graph is no package (``torch.compile``)."""
        if self.packages is None or capacity not in self.packaged_capacities:
            return False
        compiled_aot.ensure_package(self.module, example, self.packages, width, capacity, self.weights is None)
        return True

    def get(self, width: int, capacity: int, example: Callable[[], tuple]):
        """The compiled step for (width, capacity); ``example()``: inputs of its
        shapes (for a package built here)."""
        key = (width, capacity)
        graph = self.graphs.get(key)
        if graph is not None:
            return graph
        with self.opening.setdefault(key, threading.Lock()):     # opened once, by whichever thread comes first
            if key not in self.graphs:
                if self.packages is None or capacity not in self.packaged_capacities:
                    if self.traced is None:
                        self.traced = torch.compile(self.module, dynamic=False, options=self.options)
                    self.graphs[key] = self.traced
                else:
                    self.graphs[key] = compiled_aot.load_or_build(self.module, example, self.packages, width,
                                                                  capacity, self.weights)
            return self.graphs[key]


class CompiledForward:
    """Compiled fixed-shape forwards of one causal LM (``FixedGraphs`` of ``FixedStep``)."""

    def __init__(self, lm: CausalLm, ahead_of_time: bool = True, packed: bool | None = None,
                 options: dict | None = None):
        self.lm = lm
        self.layers, self.heads, self.head_dim = self._probe()
        self.module = FixedStep(lm).eval()
        self.steps = FixedGraphs(self.module, lm.model, lm.dtype, torch.device(lm.device), ahead_of_time,
                                    packed, options)
        self.capturing: FixedGraphs | None = None      # ``capture_layers``: graphs returning residual streams too
        self.due: list[tuple[int, int, bool]] = []     # (width, capacity, captures) ``warm`` left on disk
        self._settings = (ahead_of_time, packed, options)

    def capture_layers(self) -> None:
        """Add the graphs that also return the residual streams entering up to
        ``CAPTURED`` layers (EAGLE-3 features); built on ``warm(captures=True)``
        or first use."""
        if self.capturing is None:
            ahead_of_time, packed, options = self._settings
            self.capturing = FixedGraphs(FixedStep(self.lm, CAPTURED).eval(), self.lm.model, self.lm.dtype,
                                         torch.device(self.lm.device), ahead_of_time, packed, options,
                                         variant=f"captures{CAPTURED}")

    def captures(self, layers: tuple[int, ...]) -> bool:
        """Whether a forward asking for the streams entering ``layers`` can take the compiled path."""
        return not layers or (self.capturing is not None and len(layers) <= CAPTURED)

    @property
    def packed(self) -> bool:
        return self.steps.packed

    @property
    def packages(self):
        """Where this model's packages live (None: no packages)."""
        return self.steps.packages

    @torch.inference_mode()
    def _probe(self) -> tuple[int, int, int]:
        """(layers, KV heads, head dim), from a one-token eager forward; every layer must agree."""
        cache = self.lm.new_cache(1)
        self.lm.hidden(cache, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), None)
        return cache_shape(cache)

    def new_stack(self, capacity: int) -> torch.Tensor:
        return torch.zeros((self.layers, 2, 1, self.heads, capacity, self.head_dim),
                           dtype=self.lm.dtype, device=self.lm.device)

    def new_cache(self, capacity: int = 0):
        """A session cache of ``capacity_bucket(capacity)`` zeroed slots per
        layer, every layer a view into one stacked buffer; ``fit`` moves it
        up the buckets as it fills (``capacity``: the slots it needs now, not
        the most it may grow to)."""
        with torch.inference_mode():
            return stacked_cache(self.lm.new_cache(), self.new_stack(capacity_bucket(capacity)))

    @torch.inference_mode()
    def fit(self, cache, n: int) -> None:
        """Before a forward of ``n`` tokens on ``cache`` (eager or compiled):
        move a compiled-path cache too small for it (padded to its width) to
        the capacity bucket that holds it, its filled slots copied once and
        the layers' views replaced. Other caches are left as they are (an
        eager cache grows by itself)."""
        fixed = fixed_buffers(cache)
        if fixed is None:
            return
        length = kv.seq_len(cache)
        slots = length + (width_bucket(n) or n)
        if slots <= fixed.stack.shape[4]:
            return
        stack = self.new_stack(capacity_bucket(slots))
        stack[:, :, :, :, :length] = fixed.stack[:, :, :, :, :length]
        stacked_cache(cache, stack, length)

    def graph(self, width: int, capacity: int, mask, captures: bool = False):
        """The compiled step for (width, capacity), capturing or not; ``mask``
        is a padded one of the shape it takes (for a package built here)."""
        graphs = self.capturing if captures else self.steps
        return graphs.get(width, capacity, functools.partial(self._example, width, capacity, mask, captures))

    def _example(self, width: int, capacity: int, mask=None, captures: bool = False) -> tuple:
        """Inputs of the step's shapes at (width, capacity); ``mask``: a padded one (None: a causal one)."""
        pos = torch.arange(width, device=self.lm.device)[None]
        if mask is None:
            mask = padded(self.lm.masks(causal_allowed(width, 0)[None], pos.cpu(), pos.cpu()), width, capacity)
        example = (torch.zeros_like(pos), pos, mask, pos[0], self.new_stack(capacity))
        return example + (torch.arange(CAPTURED, device=self.lm.device),) if captures else example

    def accepts(self, cache, n: int) -> bool:
        """Whether a forward of n tokens on ``cache`` takes the compiled path."""
        fixed, width = fixed_buffers(cache), width_bucket(n)
        return fixed is not None and width is not None and kv.seq_len(cache) + width <= fixed.stack.shape[4]

    def forward(self, cache, tokens: torch.Tensor, positions: torch.Tensor, mask):
        """As ``CausalLm.hidden`` + ``logits`` for tokens, positions [1, n]:
        (features [1, n, H] fp32, logits [1, n, V]); None where the compiled
        path does not apply (the caller runs eagerly)."""
        out = self.run(cache, tokens, positions, mask)
        return None if out is None else (out[0], out[2])

    @torch.inference_mode()
    def run(self, cache, tokens: torch.Tensor, positions: torch.Tensor, mask, layers: tuple[int, ...] = ()):
        """``forward``, plus the residual streams entering ``layers`` (as
        ``CausalLm.hidden_and_layers``): (features, streams [1, n, len(layers)
        H] fp32 or None without layers, logits); None where the compiled path
        does not apply."""
        n = tokens.shape[1]
        if (mask is None and n > 1) or not self.accepts(cache, n) or not self.captures(layers):
            return None                  # a prefill (causal, several tokens), no fixed-shape cache, or no such graphs
        past, width = kv.seq_len(cache), width_bucket(n)
        fixed = cache.fixed_buffers
        capacity = fixed.stack.shape[4]
        if mask is None:
            k_pos = torch.cat([torch.arange(past), positions[0].cpu()])[None]
            mask = self.lm.masks(causal_allowed(n, past)[None], positions.cpu(), k_pos)
        mask = padded(mask, width, capacity)
        dev = self.lm.device
        pad = width - n
        tokens = torch.cat([tokens.to(dev), tokens.new_zeros(1, pad, device=dev)], dim=1)
        positions = torch.cat([positions.to(dev), positions[:, -1:].to(dev).expand(1, pad)], dim=1)
        slots = torch.arange(past, past + width, device=dev)
        args = (tokens, positions, mask, slots, fixed.stack)
        if layers:                       # the last index repeated up to CAPTURED, its copies dropped below
            index = torch.tensor(list(layers) + [layers[-1]] * (CAPTURED - len(layers)), device=dev)
            hidden, streams, logits = self.graph(width, capacity, mask, captures=True)(*args, index)
            streams = streams[:, :n, :len(layers) * hidden.shape[-1]]
        else:
            (hidden, logits), streams = self.graph(width, capacity, mask)(*args), None
        for i, (k, v) in enumerate(fixed.views):
            kv.adopt(cache, i, k, v, past + n)
        return hidden[:, :n], streams, logits[:, :n]

    def warm(self, widths=WIDTHS, capacities: tuple[int, ...] = PACKAGED_CAPACITIES, captures: bool = False,
             ready: tuple[int, ...] | None = None) -> float:
        """Ahead of traffic, the graphs for ``widths`` at ``capacities`` (the
        capturing ones with ``captures``), packages built where missing: those
        of ``ready`` widths (None: all) at the first capacity opened and run
        now, since a package's first run costs 70-140 ms (the demo target);
        the others left to ``open_next`` (a server opens them while idle)
        (opening them all here took a warm start-up from 1.9x to 2.5x the
        eager one); seconds taken."""
        t = time.perf_counter()
        graphs = self.capturing if captures else self.steps
        for i, capacity in enumerate(capacities):
            for width in widths:
                example = functools.partial(self._example, width, capacity, None, captures)
                if i == 0 and (ready is None or width in ready):
                    self._first_run(width, capacity, captures)
                elif (width, capacity) not in graphs.graphs and graphs.on_disk(width, capacity, example):
                    self.due.append((width, capacity, captures))
        return time.perf_counter() - t

    def _first_run(self, width: int, capacity: int, captures: bool = False) -> None:
        """Open the graph for (width, capacity) and run it once, on a throwaway cache."""
        cache = self.new_cache(capacity)
        k_pos = torch.arange(width)[None]
        mask = self.lm.masks(causal_allowed(width, 0)[None], k_pos, k_pos)
        self.run(cache, torch.zeros(1, width, dtype=torch.long), k_pos, mask, tuple(range(CAPTURED)) if captures else ())

    def open_next(self) -> bool:
        """Open and run once the next graph ``warm`` left on disk; whether one was
        left. Opening a package holds the GIL for its whole load (~70 ms for the
        demo target), which would stall any step running beside it: a server
        calls this on its engine's worker thread while no request is in flight
        (``verifier.service``); graphs still left open on first use."""
        if not self.due:
            return False
        width, capacity, captures = self.due.pop(0)
        self._first_run(width, capacity, captures)
        return True

    def open_all(self) -> None:
        """Open every graph ``warm`` left on disk (a measurement that wants none
        of that work in its timed region)."""
        while self.open_next():
            pass


def eager_forward(lm: CausalLm, cache, tokens: torch.Tensor, positions: torch.Tensor, mask):
    """The eager forward ``CompiledForward.forward`` stands in for: (features fp32, logits)."""
    hidden = lm.hidden(cache, tokens, positions, mask)
    return hidden.float(), lm.logits(hidden)


def eager_run(lm: CausalLm, cache, tokens: torch.Tensor, positions: torch.Tensor, mask,
              layers: tuple[int, ...] = ()):
    """The eager forward ``CompiledForward.run`` stands in for: (features fp32,
    the streams entering ``layers`` fp32 or None, logits)."""
    if not layers:
        hidden, streams = lm.hidden(cache, tokens, positions, mask), None
    else:
        hidden, streams = lm.hidden_and_layers(cache, tokens, positions, mask, layers)
        streams = streams.float()
    return hidden.float(), streams, lm.logits(hidden)


@torch.inference_mode()
def check_compiled(compiled: CompiledForward, layers: tuple[int, ...] = ()) -> str | None:
    """Why the compiled forward cannot serve this model (None: it can): after
    an eager prefix, a one-token step and a 3-node tree must give the eager
    logits (and the streams entering ``layers``) and leave the cache as long."""
    lm = compiled.lm
    vocab = int(lm.config.get_text_config(decoder=True).vocab_size)
    seq = torch.randint(0, vocab, (6,), generator=torch.Generator().manual_seed(0))
    ancestor = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    tree_pos = torch.tensor([5, 6, 6])
    tree = torch.stack([seq[5], seq[0], seq[1]])
    k_pos = torch.cat([torch.arange(5), tree_pos])[None]
    allowed = torch.cat([torch.ones(3, 5, dtype=torch.bool), ancestor], dim=1)[None]
    outputs = {}
    for run, step in (("compiled", compiled.run), ("eager", functools.partial(eager_run, lm))):
        cache = compiled.new_cache(16)
        lm.hidden(cache, seq[None, :4], torch.arange(4)[None], None)
        one = step(cache, seq[None, 4:5], torch.tensor([[4]]), None, layers)
        if one is None:
            return "a one-token step does not take the compiled path"
        tree_out = step(cache, tree[None], tree_pos[None], lm.masks(allowed, tree_pos[None], k_pos), layers)
        if kv.seq_len(cache) != 8:
            return f"the {run} path left {kv.seq_len(cache)} cached slots, not 8"
        outputs[run] = {f"{what} {name}": t for what, out in (("step", one), ("tree", tree_out))
                        for name, t in (("streams", out[1]), ("logits", out[2])) if t is not None}
    for name, want in outputs["eager"].items():
        got = outputs["compiled"][name]
        err = float((got - want).abs().max() / (1.0 + want.abs().max()))
        if not err <= (1e-4 if lm.dtype == torch.float32 else 5e-2):
            return f"compiled {name} differ from eager ones (relative error {err:.2g})"
    return None


@torch.inference_mode()
def time_step(lm: CausalLm, step, cache, prefix: int = 64, repeats: int = 20) -> float:
    """Median ms of ``step`` on one token after an eager ``prefix`` (cut back after each run)."""
    lm.hidden(cache, torch.zeros(1, prefix, dtype=torch.long), torch.arange(prefix)[None], None)
    times = []
    for _ in range(repeats + 2):
        t = time.perf_counter()
        step(cache, torch.zeros(1, 1, dtype=torch.long), torch.tensor([[prefix]]), None)
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
