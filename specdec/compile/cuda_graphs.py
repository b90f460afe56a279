"""CUDA graphs over the compiled fixed-shape steps (``specdec.compile.fixed_graphs``).

A compiled step (an AOTInductor package, or ``torch.compile`` past the
packaged capacities) still launches every kernel from the host: for a small
or mid-sized model on a GPU the launches, not the kernels, set a step's time.
A CUDA graph records those launches once and replays them with one call.

What a graph bakes in is addresses, so every input must sit where the graph
read it:

- the per-call inputs (tokens, positions, the padded mask, the slots; any
  dict of masks per layer type) are copied into the graph's own static
  buffers before each replay (a few KB);
- the stacked K/V buffer the step writes in place cannot be copied (it is
  the session's cache), so a graph is recorded per *buffer*: the key is the
  buffer's address, shape and strides. A session records each width it uses
  once per capacity bucket; a buffer freed and handed to the next session at
  the same address (the caching allocator does that) reuses the graphs;
- the outputs live in the graphs' memory pool and are cloned after each
  replay: every graph shares one pool, which is safe because replays are
  serialized (``LOCK``) and nothing reads a graph's outputs after the next
  replay;
- recordings are kept, least recently used dropped first, while their
  static inputs and outputs fit in ``KEPT_BYTES``.

Recording runs the step once on a side stream first (the kernels' lazy
set-up stays out of the graph), records it, and runs it once more directly to
answer the call: every run of a step with the same inputs writes the same K/V
into the same slots, so running it two or three times for one call changes
nothing. The steps recorded are ``torch.compile`` graphs: ``specdec.compile.forwards``
opens no AOTInductor packages on a GPU.

Off with ``SPECDEC_CUDA_GRAPHS=off`` (on by default on CUDA devices); a
step that fails to record runs directly from then on, with one log line.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
from collections import OrderedDict

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from specdec.model.loading import CUDA_GRAPHS_ENV, CUDA_GRAPHS_MODES

log = logging.getLogger(__name__)

# recordings kept while their static inputs and outputs fit in this (all steps together), least recently
# used dropped first: a recording per session buffer and width, so a server with many sessions keeps
# its busiest ones (the demo target's 16-wide verify holds ~0.3 MB; a 128K-vocabulary model's ~8 MB)
KEPT_BYTES = 1 << 30
LOCK = threading.RLock()     # one replay (and its output clone) at a time: the graphs share one pool
_pools: dict[int, object] = {}
_kept: OrderedDict[tuple, Recorded] = OrderedDict()     # (step id, key) -> its recording, oldest use first
_kept_bytes = 0


class Recorded:
    """One recorded step: its static inputs and outputs."""

    def __init__(self, graph, inputs: list, outputs, step):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs
        self.step = step             # held: the step's id in the key stays unique while this is kept
        tensors = [t for t in inputs if t is not None] + list(outputs[0])
        self.bytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def enabled(device: torch.device) -> bool:
    """Whether steps on ``device`` run as CUDA graphs: CUDA devices unless ``SPECDEC_CUDA_GRAPHS=off``."""
    value = os.environ.get(CUDA_GRAPHS_ENV, "on")
    if value not in CUDA_GRAPHS_MODES:
        raise ValueError(f"{CUDA_GRAPHS_ENV} must be one of {', '.join(CUDA_GRAPHS_MODES)}, got {value!r}")
    return device.type == "cuda" and value == "on"


def cache_argument(step: type[torch.nn.Module]) -> int:
    """The position of a step class's ``stack`` argument (after self): the buffer it writes in place."""
    return list(inspect.signature(step.forward).parameters).index("stack") - 1


def _pool(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _pools:
        _pools[index] = torch.cuda.graph_pool_handle()
    return _pools[index]


def _key(t) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype) if isinstance(t, torch.Tensor) else (t,)


def _keep(key: tuple, recorded: Recorded) -> None:
    global _kept_bytes
    _kept[key] = recorded
    _kept_bytes += recorded.bytes
    while _kept_bytes > KEPT_BYTES and len(_kept) > 1:
        _kept_bytes -= _kept.popitem(last=False)[1].bytes


class GraphedStep:
    """A compiled step called as ``step(*args)`` that runs as a CUDA graph per
    K/V buffer (``args[cache_arg]``); everything else is copied in (module doc)."""

    def __init__(self, step, cache_arg: int, device: torch.device, name: str = "step"):
        self.step, self.cache_arg, self.device, self.name = step, cache_arg, device, name
        self.failed = False
        self.records = self.replays = 0

    def __call__(self, *args):
        if self.failed:
            return self.step(*args)
        leaves, spec = tree_flatten(list(args))
        cache = args[self.cache_arg]
        key = (id(self), _key(cache), tuple(_key(t)[1:] if isinstance(t, torch.Tensor) else (t,) for t in leaves))
        with LOCK:
            recorded = _kept.get(key)
            if recorded is None:
                return self._record(key, args, leaves, spec)
            _kept.move_to_end(key)
            for static, t in zip(recorded.inputs, leaves):
                if static is not None and static is not t:
                    static.copy_(t, non_blocking=True)
            recorded.graph.replay()
            self.replays += 1
            return tree_unflatten([t.clone() for t in recorded.outputs[0]], recorded.outputs[1])

    def _record(self, key: tuple, args: tuple, leaves: list, spec):
        cache = args[self.cache_arg]
        # the cache buffer itself stays; every other tensor gets a static copy on the device
        inputs = [None if t is cache or not isinstance(t, torch.Tensor) else t.to(self.device, copy=True)
                  for t in leaves]
        static_args = tree_unflatten([t if s is None else s for s, t in zip(inputs, leaves)], spec)
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.step(*static_args)                          # lazy set-up outside the graph
                side.synchronize()
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=_pool(self.device), capture_error_mode="thread_local")
                try:
                    outputs = tree_flatten(self.step(*static_args))
                finally:
                    graph.capture_end()
            torch.cuda.current_stream(self.device).wait_stream(side)
        except Exception as exc:  # noqa: BLE001 - any failure: this step runs without graphs
            self.failed = True
            log.warning("CUDA graphs off for the compiled %s: recording failed (%s: %s); it runs directly",
                        self.name, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return self.step(*args)
        self.records += 1
        _keep(key, Recorded(graph, inputs, outputs, self))
        return self.step(*args)        # answers the call, and leaves the step's own state outside a graph
