"""Compiled target forwards over a fixed-shape KV view (``--compile``).

An eager forward of a small model is mostly per-operator dispatch and Python
(``specdec bench profile`` measures the share). ``torch.compile`` (inductor)
removes it only if the shapes stop changing from one step to the next, so the
compiled path never lets them change, as gpt-fast does with a static cache:

- the cache: a session's in-place cache (``specdec.model.kv.SlabLayer``) whose
  layers are views into one stacked buffer [layers, 2, 1, heads, C, d] at a
  *capacity bucket* (a power of two >= 256 slots), zero-filled: every step
  gets the same shapes, and one K/V input instead of one per layer (each
  input is a Dynamo guard and a wrapper argument). A session starts in the
  smallest bucket and moves up (its filled slots copied once, ``fit``) when a
  forward would pass its capacity: every step attends over all C slots, so
  C follows the session's length, not the length it may grow to (a step
  over 256 slots takes ~0.8x the one over 512 on the demo target);
- the writes: the step writes its n new K/V into slots [L, L + n) of that
  buffer with one indexed write per layer (``specdec.compile.fixed_kv``), slot indices as a
  tensor, so the length L is data, not shape; the cache length moves
  afterwards, outside;
- the mask: the forward's additive mask [1, 1, n, L + n] (tree or causal, per
  layer type for windowed models) padded to [1, 1, nb, C] with the dtype's
  minimum: slots past the length are invisible (they are zeros, never NaN);
- the width: n is padded up to the next of ``WIDTHS`` (1, 2, 4, ... 64); pad
  queries see only their own slot and their outputs are dropped.

One graph per (width, capacity) pair. At the smallest capacities
(``PACKAGED_CAPACITIES``) the graphs are
ahead-of-time compiled packages kept on disk (``specdec.compile.aot``): a
restart loads them instead of tracing the model again, and their calls skip
Dynamo's guards and the Python wrapper. A small model's packages (weights
times ``WIDTHS`` within ``PACKED_BUDGET``) hold their own copy of the weights
packed for inductor's CPP GEMM kernels, which beat a BLAS call per linear on
these GEMV shapes; a larger model's packages run over its own parameters,
one copy for all widths. Those of a default-sized tree and of a prefill
chunk are built or loaded at start-up (``STARTUP_WIDTHS``, at every packaged
capacity);
those of a root-only cycle and a default tree (``READY_WIDTHS``) are opened
and run once at the first capacity before readiness, the rest by the verifier
service while no request is in flight (``open_next``: the first session to
pass 256 slots no longer pays ~180 ms for them), or on first use; larger
capacities (long sessions) use ``torch.compile`` on first use. A package's
key digests the traced code only (``specdec.compile.fixed_step``, ``specdec.compile.fixed_kv``),
so editing this module keeps the packages on disk.

EAGLE-3 drafters read the residual streams entering three of the target's
layers: their sessions' forwards take a second set of graphs
(``capture_layers``) that also return the streams of up to ``CAPTURED``
layers, picked by an index tensor (data, not shape: one set serves any
head). It is built only where such sessions are expected (``--compile-
feature-layers``, or an in-process EAGLE-3 drafter): returning the streams
costs ~7% of a one-token step, which EAGLE-1/2 and plain decoding do not pay.
Without it those sessions run eagerly (one log line says so).

A prefill (a causal forward of several tokens) runs in chunks of
``PREFILL_WIDTH`` tokens through the same graphs (``prefill``): ~1.4x faster
than one eager forward of a 192-token prompt on the demo target. Several
sessions' rows verified together (batched verification) take graphs whose
batch dimension is free (``batch_graphs``, ``specdec.compile.batched``).
A model that fails to compile, or whose compiled logits differ from its
eager ones on a check at load, runs eagerly with one log line saying why
(``specdec.compile.startup``). With ``auto`` the compiled path is also timed
against the eager one on a one-token step and kept only where it pays.

On a CUDA device the graphs are ``torch.compile`` ones (no packages: see
``CompiledForward``), all compiled at start-up, and every call replays as a
CUDA graph recorded per K/V buffer (``specdec.compile.cuda_graphs``); batched
verification there runs row by row over them (batched graphs are packages).
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from specdec.compile.fixed_graphs import (MAX_BATCH, PACKAGED_CAPACITIES, PACKED_BUDGET, WIDTHS, FixedGraphs,
                                          ahead_setting)
from specdec.compile.fixed_kv import cache_shape, fixed_buffers, padded, stacked_cache
from specdec.compile.eager import eager_run
from specdec.compile.fixed_step import FixedStep
from specdec.model import kv
from specdec.model.causal_lm import CausalLm
from specdec.model.masks import causal_allowed
from specdec.tree.placed import BITS, SEEN
from specdec.request.knobs import DEFAULT_TOTAL_TOKENS

log = logging.getLogger(__name__)


__all__ = ["MAX_BATCH", "PACKED_BUDGET", "FixedGraphs", "FixedStep"]   # and what follows

MIN_CAPACITY = PACKAGED_CAPACITIES[0]   # capacity buckets: powers of two from here
PAYS = 0.9                              # auto: compiled must take at most this share of the eager step time
ALIBI_REASON = "ALiBi models run their own blocks with per-row biases (specdec.model.alibi), not one fixed-shape forward"
# compiled at start-up: every width a default-sized tree pads to (larger trees compile on first use)
STARTUP_WIDTHS = tuple(w for w in WIDTHS if w <= DEFAULT_TOTAL_TOKENS)
# a prefill runs in chunks of this many tokens (``CompiledForward.prefill``), compiled at these capacities
# only (built at start-up too): at 512 slots a 64-token chunk of the demo target took 1.8x its 256-slot
# time (the graph's attention over every slot), and a 400-token prefill 1.25x the eager one
PREFILL_WIDTH, PREFILL_CAPACITIES = WIDTHS[-1], PACKAGED_CAPACITIES[:1]
# of those, opened and run before readiness: a root-only cycle's and a default tree's (the ones the check
# at load runs); the others open while the server is idle (``open_next``) or on first use
READY_WIDTHS = (1, next(w for w in WIDTHS if w >= DEFAULT_TOTAL_TOKENS))
SPARE_BATCHES = 4                       # batch caches kept for reuse, the latest shapes (``CompiledForward.reuse``)
CAPTURED = 3                            # residual streams a capturing graph returns (an EAGLE-3 head reads 3)


def capacity_bucket(slots: int) -> int:
    """The fixed capacity a cache reserving ``slots`` gets: a power of two >= MIN_CAPACITY."""
    c = MIN_CAPACITY
    while c < slots:
        c *= 2
    return c


def width_bucket(n: int) -> int | None:
    return next((w for w in WIDTHS if w >= n), None)


class CompiledForward:
    """Compiled fixed-shape forwards of one causal LM (``FixedGraphs`` of ``FixedStep``)."""

    def __init__(self, lm: CausalLm, ahead_of_time: bool | None = None, packed: bool | None = None,
                 options: dict | None = None):
        """``ahead_of_time`` (None: on CPU) keeps the graphs as packages on disk;
        without them every graph is a ``torch.compile`` one, compiled at
        ``warm``. On a GPU they replay as CUDA graphs either way, which takes
        the per-call cost the packages save on CPU out of the step (and
        AOTInductor packages built for CUDA by torch 2.11 crashed at load)."""
        if ahead_of_time is None:
            ahead_of_time = torch.device(lm.device).type == "cpu"
        self.lm = lm
        self.layers, self.heads, self.head_dim = self._probe()
        self.module = FixedStep(lm).eval()
        self.steps = FixedGraphs(self.module, lm.model, lm.dtype, torch.device(lm.device), ahead_of_time,
                                    packed, options)
        self.capturing: FixedGraphs | None = None      # ``capture_layers``: graphs returning residual streams too
        self.batched: dict[bool, FixedGraphs] = {}     # ``batch_graphs``: captures -> graphs taking B > 1 rows
        self.due: list[tuple[int, int, bool, bool]] = []    # (width, capacity, captures, batched) ``warm`` left
        self.spare: dict[tuple[int, int], object] = {}     # (rows, capacity) -> a batch cache to reuse
        self._settings = (ahead_of_time, packed, options)
        # a package missing from disk is built on first use (minutes); False (a server, ``unbuilt_eager``):
        # that forward runs eagerly instead, one log line per width
        self.build_on_use = True
        self._told_unbuilt: set[int] = set()
        self._layer_indices: dict[tuple[int, ...], torch.Tensor] = {}   # ``_layer_index``

    def capture_layers(self) -> None:
        """Add the graphs that also return the residual streams entering up to
        ``CAPTURED`` layers (EAGLE-3 features); built on ``warm(captures=True)``
        or first use."""
        if self.capturing is None:
            ahead_of_time, packed, options = self._settings
            self.capturing = FixedGraphs(FixedStep(self.lm, CAPTURED).eval(), self.lm.model, self.lm.dtype,
                                         torch.device(self.lm.device), ahead_of_time, packed, options,
                                         variant=f"captures{CAPTURED}")

    def batch_graphs(self) -> None:
        """Add graphs taking several sessions' rows at once (batched
        verification, ``specdec.compile.batched``): one package per width and
        packaged capacity whose batch dimension is free; for the capturing
        graphs too where those exist. Built on ``warm(batched=True)``."""
        ahead_of_time, packed, options = self._settings
        for captures, graphs in ((False, self.steps), (True, self.capturing)):
            if graphs is not None and captures not in self.batched:
                self.batched[captures] = FixedGraphs(graphs.module, self.lm.model, self.lm.dtype,
                                                     torch.device(self.lm.device), ahead_of_time, packed, options,
                                                     variant=f"captures{CAPTURED}" if captures else "", batched=True)

    def graph_set(self, captures: bool = False, batched: bool = False) -> FixedGraphs | None:
        """The graphs of one kind (None: not built)."""
        return self.batched.get(captures) if batched else self.capturing if captures else self.steps

    def some_layers(self) -> tuple[int, ...]:
        """``CAPTURED`` layer indices of this model (repeated where it has fewer layers): a capturing graph's example."""
        return tuple(i % self.layers for i in range(CAPTURED))

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

    def new_stack(self, capacity: int, rows: int = 1) -> torch.Tensor:
        return torch.zeros((self.layers, 2, rows, self.heads, capacity, self.head_dim),
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
        stack = self.new_stack(capacity_bucket(slots), fixed.stack.shape[2])
        stack[:, :, :, :, :length] = fixed.stack[:, :, :, :, :length]
        stacked_cache(cache, stack, length)

    @torch.inference_mode()
    def batch_cache(self, caches: list, lengths: list[int], n: int, layers: tuple[int, ...] = ()):
        """A compiled-path cache for one batched forward of ``n`` tokens a row
        over ``caches`` (one row each): row b holds ``caches[b]``'s first
        ``lengths[b]`` slots, then zeros up to the longest (masked, never
        NaN); the forward writes every row's tokens after that. One copy of
        every prefix. None where no batched graph serves it. ``reuse`` it
        when done: the next batch of its shape takes its buffer (the slots
        past a row's prefix then hold an earlier batch's K/V: masked, finite)."""
        if not self.serves_batch(lengths, n, layers):
            return None
        width, prefix = width_bucket(n), max(lengths)
        key = (len(caches), capacity_bucket(prefix + width))
        batch = self.spare.pop(key, None)
        if batch is None:
            batch = stacked_cache(self.lm.new_cache(), self.new_stack(key[1], key[0]))
        stack = batch.fixed_buffers.stack
        for b, (cache, length) in enumerate(zip(caches, lengths)):
            fixed = fixed_buffers(cache)
            if fixed is not None:
                stack[:, :, b, :, :length] = fixed.stack[:, :, 0, :, :length]
                continue
            for i, layer in enumerate(cache.layers):
                stack[i, 0, b, :, :length] = layer.keys[0, :, :length]
                stack[i, 1, b, :, :length] = layer.values[0, :, :length]
        for i, (k, v) in enumerate(batch.fixed_buffers.views):
            kv.adopt(batch, i, k, v, prefix)
        return batch

    def reuse(self, batch) -> None:
        """Keep a ``batch_cache`` no longer used for the next batch of its shape."""
        fixed = fixed_buffers(batch)
        if fixed is not None:
            self.spare[(fixed.stack.shape[2], fixed.stack.shape[4])] = batch
            while len(self.spare) > SPARE_BATCHES:         # the oldest shape goes (dicts keep insertion order)
                self.spare.pop(next(iter(self.spare)))

    @torch.inference_mode()
    def append_row(self, cache, batch, row: int, slots: torch.Tensor) -> bool:
        """Append row ``row``'s ``slots`` [m] of a ``batch_cache`` to a session's
        compiled-path cache, every layer in one copy; False where either is not
        one (the caller appends layer by layer)."""
        self.fit(cache, slots.numel())
        fixed, source = fixed_buffers(cache), fixed_buffers(batch)
        if fixed is None or source is None:
            return False
        length, end = kv.seq_len(cache), kv.seq_len(cache) + slots.numel()
        fixed.stack[:, :, 0, :, length:end] = source.stack[:, :, row].index_select(3, slots)
        for i, (k, v) in enumerate(fixed.views):
            kv.adopt(cache, i, k, v, end)
        return True

    def serves_batch(self, lengths: list[int], n: int, layers: tuple[int, ...] = ()) -> bool:
        """Whether a batched graph serves rows of prefixes ``lengths`` and ``n`` tokens each (``batch_cache``)."""
        width = width_bucket(n)
        return (width is not None and 2 <= len(lengths) <= MAX_BATCH
                and self.batches(width, capacity_bucket(max(lengths) + width), layers))

    def takes(self, cache, n: int, layers: tuple[int, ...] = ()) -> bool:
        """Whether a forward of ``n`` tokens on ``cache`` (asking for the streams
        entering ``layers``) takes the compiled path once ``fit``."""
        return fixed_buffers(cache) is not None and width_bucket(n) is not None and self.captures(layers)

    def graph(self, width: int, capacity: int, mask, captures: bool = False, rows: int = 1):
        """The compiled step for (width, capacity), capturing or not, for
        ``rows`` sessions' rows (> 1: a batched graph); ``mask`` is a padded
        one of the shape it takes (for a package built here)."""
        graphs = self.graph_set(captures, rows > 1)
        return graphs.get(width, capacity, functools.partial(self._example, width, capacity,
                                                             mask if rows == 1 else None, captures, min(rows, 2)))

    def _example(self, width: int, capacity: int, mask=None, captures: bool = False, rows: int = 1) -> tuple:
        """Inputs of the step's shapes at (width, capacity) for ``rows`` rows;
        ``mask``: a padded one (None: a causal one)."""
        pos = torch.arange(width, device=self.lm.device)[None].repeat(rows, 1)     # dense: the package keeps strides
        if mask is None:
            allowed = causal_allowed(width, 0)[None].repeat(rows, 1, 1)
            mask = padded(self.lm.masks(allowed, pos.cpu(), pos.cpu()), width, capacity)
        example = (torch.zeros_like(pos), pos, mask, pos[0], self.new_stack(capacity, rows))
        return example + (torch.tensor(self.some_layers(), device=self.lm.device),) if captures else example

    def accepts(self, cache, n: int) -> bool:
        """Whether a forward of n tokens on ``cache`` takes the compiled path."""
        fixed, width = fixed_buffers(cache), width_bucket(n)
        return fixed is not None and width is not None and kv.seq_len(cache) + width <= fixed.stack.shape[4]

    def batches(self, width: int, capacity: int, layers: tuple[int, ...] = ()) -> bool:
        """Whether a batched graph serves several rows at (width, capacity) (with the streams entering ``layers``)."""
        graphs = self.batched.get(bool(layers))
        return graphs is not None and graphs.serves(width, capacity) and len(layers) <= CAPTURED

    def forward(self, cache, tokens: torch.Tensor, positions: torch.Tensor, mask):
        """As ``CausalLm.hidden`` + ``logits`` for tokens, positions [1, n]:
        (features [1, n, H] fp32, logits [1, n, V]); None where the compiled
        path does not apply (the caller runs eagerly)."""
        out = self.run(cache, tokens, positions, mask)
        return None if out is None else (out[0], out[2])

    @torch.inference_mode()
    def run(self, cache, tokens: torch.Tensor, positions: torch.Tensor, mask, layers: tuple[int, ...] = (),
            resident: bool = False):
        """``forward``, plus the residual streams entering ``layers`` (as
        ``CausalLm.hidden_and_layers``): (features, streams [1, n, len(layers)
        H] fp32 or None without layers, logits); None where the compiled path
        does not apply. A prefill (``mask`` None, several tokens) runs in
        chunks (``prefill``)."""
        rows, n = tokens.shape
        if mask is None and n > 1:
            return self.prefill(cache, tokens, positions, layers) if rows == 1 else None
        if not self.accepts(cache, n) or not self.captures(layers):
            return None                  # no fixed-shape cache, or no such graphs
        width, capacity = width_bucket(n), cache.fixed_buffers.stack.shape[4]
        if rows > 1 and not self.batches(width, capacity, layers):
            return None
        if rows == 1 and not self.build_on_use and not self.built(width, capacity, bool(layers)):
            if width not in self._told_unbuilt:
                self._told_unbuilt.add(width)
                log.warning("no compiled graph for %d-wide forwards was built at start-up: those run eagerly "
                            "(verifier serve --compile-tree-tokens builds them)", width)
            return None
        return self._step(cache, tokens, positions, mask, layers, width, resident)

    def built(self, width: int, capacity: int, captures: bool = False) -> bool:
        """Whether the one-session graph for (width, capacity) is open or on disk,
        or is no package (``torch.compile``, compiled on first use anyway)."""
        graphs = self.graph_set(captures)
        return (graphs.packages is None or capacity not in graphs.packaged_capacities
                or graphs.ready(width, capacity))

    @torch.inference_mode()
    def prefill(self, cache, tokens: torch.Tensor, positions: torch.Tensor, layers: tuple[int, ...] = ()):
        """A causal forward of tokens, positions [1, n] as ``run``, in chunks of
        ``PREFILL_WIDTH`` tokens, the last one padded to a start-up width (16
        tokens at most) or to ``PREFILL_WIDTH``: a chunk at ``PREFILL_CAPACITIES``
        whose graph is open or on disk runs compiled; from the first that
        cannot, the rest runs in one eager forward (nothing is compiled on a
        request); None where the cache is not a compiled-path one."""
        if fixed_buffers(cache) is None or not self.captures(layers):
            return None
        graphs, outs, n = self.capturing if layers else self.steps, [], tokens.shape[1]
        for start in range(0, n, PREFILL_WIDTH):
            end = min(n, start + PREFILL_WIDTH)
            width = width_bucket(end - start) if end - start <= max(STARTUP_WIDTHS) else PREFILL_WIDTH
            self.fit(cache, width)
            chunk = (tokens[:, start:end], positions[:, start:end])
            capacity = cache.fixed_buffers.stack.shape[4]
            if capacity in PREFILL_CAPACITIES and graphs.ready(width, capacity):
                outs.append(self._step(cache, *chunk, None, layers, width))
                continue
            self.fit(cache, n - start)           # the rest in one eager forward (an eager chunk costs its dispatch)
            outs.append(eager_run(self.lm, cache, tokens[:, start:], positions[:, start:], None, layers))
            break
        return tuple(None if parts[0] is None else torch.cat(parts, dim=1) for parts in zip(*outs))

    def _step(self, cache, tokens: torch.Tensor, positions: torch.Tensor, mask, layers, width: int, resident=False):
        """One compiled forward padded to ``width`` (``run``; mask None: causal; ``resident``: on the device)."""
        rows, n = tokens.shape
        past, capacity = kv.seq_len(cache), cache.fixed_buffers.stack.shape[4]
        if mask is None:                 # the causal mask, built on the host (where a tree's positions are)
            q_pos = positions if positions.device.type == "cpu" else positions.cpu()
            k_pos = torch.cat([torch.arange(past), q_pos[0]])[None]
            mask = self.lm.masks(causal_allowed(n, past)[None], q_pos, k_pos)
        dev = self.lm.device
        pad = width - n
        if resident or (tokens.device == positions.device and tokens.dtype == positions.dtype):
            # padded where they are (the host, from a tree: then one copy to the device; resident: there)
            both = torch.stack([torch.cat([tokens, tokens.new_zeros(rows, pad)], dim=1),
                                torch.cat([positions, positions[:, -1:].expand(rows, pad)], dim=1)])
            tokens, positions = both if resident else both.to(dev)
        else:
            tokens = torch.cat([tokens.to(dev), tokens.new_zeros(rows, pad, device=dev)], dim=1)
            positions = torch.cat([positions.to(dev), positions[:, -1:].to(dev).expand(rows, pad)], dim=1)
        slots = torch.arange(past, past + width, device=dev)
        return self._replay(cache, tokens, positions, padded(mask, width, capacity), slots, layers, n)

    def tree_applies(self, cache, n: int, layers: tuple[int, ...] = ()) -> bool:
        """Whether ``run_placed`` runs a tree of ``n`` nodes on ``cache`` (once ``fit``)."""
        width = width_bucket(n)
        return (width is not None and self.accepts(cache, n) and self.captures(layers)
                and (self.build_on_use or self.built(width, cache.fixed_buffers.stack.shape[4], bool(layers))))

    @torch.inference_mode()
    def run_placed(self, cache, placed, layers: tuple[int, ...] = ()):
        """``run`` of a tree placed on the device (``specdec.tree.placed``,
        ``tree_applies``): its tokens, positions and slots are the placed
        rows, its mask built there from their bits: nothing more goes up."""
        past, n = kv.seq_len(cache), placed.n
        if past != placed.prefix_len or placed.width != width_bucket(n):
            raise ValueError(f"a tree placed {placed.width} wide after {placed.prefix_len} slots, on {past}")
        mask = self.lm.layout.bits_masks(placed.packed[SEEN], placed.packed[BITS], placed.positions[0], past, n,
                                         cache.fixed_buffers.stack.shape[4], self.lm.dtype)
        return self._replay(cache, placed.tokens, placed.positions, mask, placed.slots, layers, n)

    def _replay(self, cache, tokens: torch.Tensor, positions: torch.Tensor, mask, slots: torch.Tensor,
                layers: tuple[int, ...], n: int):
        """The graph for tokens, positions [rows, width], a padded mask and slots [width]; n real tokens."""
        (rows, width), past, fixed = tokens.shape, kv.seq_len(cache), cache.fixed_buffers
        capacity, args = fixed.stack.shape[4], (tokens, positions, mask, slots, fixed.stack)
        if layers:                       # the last index repeated up to CAPTURED, its copies dropped below
            hidden, streams, logits = self.graph(width, capacity, mask, True, rows)(*args, self._layer_index(layers))
            streams = streams[:, :n, :len(layers) * hidden.shape[-1]]
        else:
            (hidden, logits), streams = self.graph(width, capacity, mask, False, rows)(*args), None
        for i, (k, v) in enumerate(fixed.views):
            kv.adopt(cache, i, k, v, past + n)
        return hidden[:, :n], streams, logits[:, :n]

    def _layer_index(self, layers: tuple[int, ...]) -> torch.Tensor:
        """The capturing graphs' layer index for ``layers`` on the device, made once per layers."""
        if layers not in self._layer_indices:
            self._layer_indices[layers] = torch.tensor(list(layers) + [layers[-1]] * (CAPTURED - len(layers)),
                                                       device=self.lm.device)
        return self._layer_indices[layers]

    def warm(self, widths=WIDTHS, capacities: tuple[int, ...] = PACKAGED_CAPACITIES, captures: bool = False,
             ready: tuple[int, ...] | None = None, batched: bool = False) -> float:
        """Ahead of traffic, the graphs for ``widths`` at ``capacities`` (the
        capturing ones with ``captures``, the batched ones with ``batched``:
        ``batch_graphs``), packages built where missing: those
        of ``ready`` widths (None: all) at the first capacity opened and run
        now, since a package's first run costs 70-140 ms (the demo target);
        the others left to ``open_next`` (a server opens them while idle)
        (opening them all here took a warm start-up from 1.9x to 2.5x the
        eager one); with ``SPECDEC_COMPILE_AHEAD=ready`` (``ahead_setting``)
        those others are not built here, only opened while idle where already
        on disk (batched graphs, never built on a request: those at the first
        capacity built, the others left to row-by-row batches); seconds taken."""
        t = time.perf_counter()
        graphs = self.graph_set(captures, batched)
        rows = 2 if batched else 1
        ahead = ahead_setting() == "all"
        for i, capacity in enumerate(capacities):
            build = ahead or (batched and i == 0)        # batched graphs are never built on a request
            for width in widths:
                example = functools.partial(self._example, width, capacity, None, captures, rows)
                if (i == 0 and (ready is None or width in ready)) or (graphs.packages is None and build):
                    self._first_run(width, capacity, captures, batched)     # (no package: compiled now)
                elif graphs.packages is None or (width, capacity) in graphs.graphs:
                    continue
                elif graphs.on_disk(width, capacity, example) if build else graphs.ready(width, capacity):
                    self.due.append((width, capacity, captures, batched))
        return time.perf_counter() - t

    def _first_run(self, width: int, capacity: int, captures: bool = False, batched: bool = False) -> None:
        """Open the graph for (width, capacity) and run it once, on a throwaway cache (two rows: a batched graph)."""
        rows = 2 if batched else 1
        with torch.inference_mode():
            cache = stacked_cache(self.lm.new_cache(), self.new_stack(capacity, rows))
        k_pos = torch.arange(width)[None].expand(rows, width)
        mask = self.lm.masks(causal_allowed(width, 0)[None].expand(rows, -1, -1), k_pos, k_pos)
        self.run(cache, torch.zeros(rows, width, dtype=torch.long), k_pos, mask,
                 self.some_layers() if captures else ())

    def open_next(self) -> bool:
        """Open and run once the next graph ``warm`` left on disk; whether one was
        left. Opening a package holds the GIL for its whole load (~70 ms for the
        demo target), which would stall any step running beside it: a server
        calls this on its engine's worker thread while no request is in flight
        (``verifier.service``); graphs still left open on first use."""
        if not self.due:
            return False
        self._first_run(*self.due.pop(0))
        return True

    def open_all(self) -> None:
        """Open every graph ``warm`` left on disk (a measurement that wants none
        of that work in its timed region)."""
        while self.open_next():
            pass

