"""The compiled graphs of one fixed-shape step module (``specdec.compile.forwards``,
``drafter.compiled.head_levels``): one per (width, capacity), ahead-of-time packages
on disk at the packaged capacities, ``torch.compile`` past them; batched
graphs (several sessions' rows in one forward) as packages whose batch
dimension is free."""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable

import torch

from specdec.compile import aot, cuda_graphs, row_products
from specdec.compile.fixed_kv import FixedLayer
from specdec.model.loading import (AHEAD_ENV, AHEAD_MODES, COMPILE_MODES, PACKED_ENV, PACKED_HEADS_ENV,
                                   ROW_PRODUCTS_ENV, stored_tensors)

WIDTHS = (1, 2, 4, 8, 16, 32, 64)      # compiled query widths; a forward is padded up to the next one
PACKAGED_CAPACITIES = (256, 512)        # capacities with ahead-of-time packages (built at start-up)
PACKED_BUDGET = 1 << 30                 # packed weights (one copy per package) only while they fit in this
MAX_BATCH = 256                         # the most rows a batched graph takes (its batch dimension is free up to it)


def packed_setting() -> str:
    """``SPECDEC_COMPILE_PACKED``: auto (default: packed weights for a small
    model on CPU), on or off. Packed packages step ~2x faster on a small CPU
    model and take ~3x as long to build (and a copy of the weights each);
    off builds over the model's own weights (one BLAS call per linear)."""
    return compile_setting(PACKED_ENV)


def packed_heads_setting() -> str:
    """``SPECDEC_COMPILE_PACKED_HEADS``: the same for EAGLE heads' draft levels
    (auto, the default, and on: packed where the copies fit; off: over the
    head's own weights). A switch of its own: a head is small, and drafting
    over unpacked weights took ~2x as long a cycle (SmolLM2's head: ~20 ms
    against ~9), so turning packing off for a large target's memory need not
    cost the head its speed."""
    return compile_setting(PACKED_HEADS_ENV)


def row_products_setting() -> str:
    """``SPECDEC_COMPILE_ROW_PRODUCTS``: auto (default) and on compile the
    one-row products of a half-precision model's linear layers, and its
    attention for one query row, on CPU as streaming loops
    (``specdec.compile.row_products``; graphs over the model's own weights:
    packed ones keep inductor's GEMM template); off leaves them BLAS calls and SDPA."""
    return compile_setting(ROW_PRODUCTS_ENV)


def compile_setting(variable: str) -> str:
    value = os.environ.get(variable, "auto")
    if value not in COMPILE_MODES:
        raise ValueError(f"{variable} must be one of {', '.join(COMPILE_MODES)}, got {value!r}")
    return value


def ahead_setting() -> str:
    """``SPECDEC_COMPILE_AHEAD``: which graphs are built before a model serves.
    ``all`` (default): every width a default-sized tree and a prefill chunk
    pad to, at every packaged capacity, so no request waits for a build.
    ``ready``: only those opened before readiness anyway (a root-only cycle's
    and a default tree's, at the first capacity, and the batched graphs at
    the first capacity); any other graph is built the first time a forward
    needs it, and that forward waits for it (seconds to a minute on CPU),
    except batched ones, never built on a request (such batches run row by
    row), and prefill chunks (a prompt then runs eagerly). For development and test runs that start many models
    and use few of their graphs; a package already on disk is opened while
    idle as with ``all``."""
    value = os.environ.get(AHEAD_ENV, "all")
    if value not in AHEAD_MODES:
        raise ValueError(f"{AHEAD_ENV} must be one of {', '.join(AHEAD_MODES)}, got {value!r}")
    return value


def batch_dims(example: tuple) -> tuple:
    """The dynamic shapes ``torch.export`` takes for a ``FixedStep``'s inputs
    with the batch left free (2 to ``MAX_BATCH`` rows): dim 0 of the tokens,
    positions and mask (each layer type's), dim 2 of the stacked cache."""
    batch = torch.export.Dim("batch", min=2, max=MAX_BATCH)
    mask, rest = example[2], example[5:]
    masks = {kind: {0: batch} for kind in mask} if isinstance(mask, dict) else {0: batch}
    return ({0: batch}, {0: batch}, masks, None, {2: batch}, *(None for _ in rest))


class Replayed:
    """A compiled step as ``FixedGraphs.get`` hands it out: the step itself,
    called through ``REPLAY_WATCH`` when one is set (``specdec.bench.cycle_profile``
    counts replays there, and nothing of what runs inside them)."""

    __slots__ = ("step", "name")

    def __init__(self, step, name: str):
        self.step, self.name = step, name

    def __call__(self, *args):
        watch = REPLAY_WATCH[0]
        if watch is None:
            return self.step(*args)
        with watch(self.name):
            return self.step(*args)


# the watch of replays: None, or a context-manager factory called with each replay's graph name
REPLAY_WATCH: list = [None]


class FixedGraphs:
    """The compiled graphs of one fixed-shape step module, one per (width,
    capacity): at ``packaged_capacities`` AOTInductor packages kept on disk
    (``specdec.compile.aot``) when ``ahead_of_time``, packed (their own copy
    of the weights, for inductor's CPP GEMM) for a small ``model`` on CPU or
    when ``packed``; at larger capacities (or without packages) ``torch.compile``;
    on CUDA, each replayed as CUDA graphs (``specdec.compile.cuda_graphs``)."""

    def __init__(self, module: torch.nn.Module, model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                 ahead_of_time: bool = True, packed: bool | None = None, options: dict | None = None,
                 sources: tuple[str, ...] = (), packaged_capacities: tuple[int, ...] = PACKAGED_CAPACITIES,
                 variant: str = "", batched: bool = False):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.module = module
        self.options = options
        self.traced = None                 # torch.compile of the module, made on first need (it costs ~2 s)
        sources = (*sources, inspect.getfile(FixedLayer))     # every step writes its K/V through it
        # every stored weight: a quantized layer's weights are buffers (``specdec.model.quantize``), and
        # counting parameters alone once packed an int8 SmolLM2 (14 copies of its weights, a 16-minute build)
        weight_bytes = sum(t.numel() * t.element_size() for t in stored_tensors(model))
        if packed is None:               # one packed copy of the weights per package: small models only
            packed = {"on": True, "off": False}.get(packed_setting(), device.type == "cpu" and weight_bytes * len(
                WIDTHS) * len(packaged_capacities) <= PACKED_BUDGET)
        self.packed = ahead_of_time and packed
        self.packages = (aot.package_dir(module, model, dtype, device, sources, variant, self.packed)
                         if ahead_of_time else None)
        # one-row graphs with their products as streaming loops (``specdec.compile.row_products``) are
        # keyed apart, in a directory of their own: the other widths' packages stay valid either way
        self.one_row_packages = self.packages
        if device.type == "cpu" and not self.packed and not batched and row_products_setting() != "off":
            if row_products.install(module) and ahead_of_time:
                self.one_row_packages = aot.package_dir(module, model, dtype, device,
                                                        (*sources, inspect.getfile(row_products)),
                                                        f"{variant}-rows" if variant else "rows", self.packed)
        elif not batched:
            row_products.uninstall(module)
        for root in {self.packages, self.one_row_packages} - {None}:
            aot.mark_used(root)                  # and, once per process, prune unused ones
        self.weights = aot.shared_weights(module) if ahead_of_time and not self.packed else None
        self.graphs: dict[tuple[int, int], object] = {}      # (width, capacity) -> the compiled step
        self.replayed: dict[tuple[int, int], Replayed] = {}  # the same, as ``get`` hands them out
        self.opening: dict[tuple[int, int], threading.Lock] = {}   # held while that graph is opened
        self.packaged_capacities = tuple(packaged_capacities)
        self.batch_dims = batch_dims if batched else None     # batched: packages only, their batch dimension free
        # on CUDA every graph replays as CUDA graphs recorded per K/V buffer (``specdec.compile.cuda_graphs``)
        self.device = device
        self.cuda_graphs = cuda_graphs.enabled(device)

    def serves(self, width: int, capacity: int) -> bool:
        """Whether the graph for (width, capacity) is open or can be had: batched
        ones only where built (``on_disk``), never compiled on a request."""
        return self.batch_dims is None or self.ready(width, capacity)

    def ready(self, width: int, capacity: int) -> bool:
        """Whether the graph for (width, capacity) is open or its package is on disk."""
        return (width, capacity) in self.graphs or (
            self.packages is not None and capacity in self.packaged_capacities
            and aot.package_built(aot.package_path(
                self.root(width), width, capacity, self.weights is None, self.batch_dims is not None)))

    def root(self, width: int):
        """The directory of the packages at ``width``."""
        return self.one_row_packages if width == 1 else self.packages

    def on_disk(self, width: int, capacity: int, example: Callable[[], tuple]) -> bool:
        """Build the package for (width, capacity) if it is missing, without
        loading it; False where that graph is no package (``torch.compile``)."""
        if self.packages is None or capacity not in self.packaged_capacities:
            return False
        aot.ensure_package(self.module, example, self.root(width), width, capacity, self.weights is None,
                                    self.batch_dims)
        return True

    def get(self, width: int, capacity: int, example: Callable[[], tuple]):
        """The compiled step for (width, capacity); ``example()``: inputs of its
        shapes (for a package built here)."""
        key = (width, capacity)
        graph = self.replayed.get(key)
        if graph is not None:
            return graph
        with self.opening.setdefault(key, threading.Lock()):     # opened once, by whichever thread comes first
            if key not in self.graphs:
                if self.batch_dims is not None and (self.packages is None
                                                    or capacity not in self.packaged_capacities):
                    raise ValueError(f"no batched graph at capacity {capacity}")
                if self.packages is None or capacity not in self.packaged_capacities:
                    if self.traced is None:
                        self.traced = torch.compile(self.module, dynamic=False, options=self.options)
                    graph = self.traced
                else:
                    graph = aot.load_or_build(self.module, example, self.root(width), width, capacity,
                                                       self.weights, self.batch_dims)
                if self.cuda_graphs:
                    step = type(self.module)
                    graph = cuda_graphs.GraphedStep(graph, cuda_graphs.cache_argument(step), self.device,
                                                    f"{step.__name__} w{width} c{capacity}")
                self.graphs[key] = graph
                self.replayed[key] = Replayed(graph, f"{type(self.module).__name__} w{width} c{capacity}")
            return self.replayed[key]
