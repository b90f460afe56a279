"""The KV cache: transformers' ``DynamicCache`` over layers that grow in place,
and the named operations speculative decoding does on it.

transformers' ``DynamicLayer`` concatenates on every update, so appending n
slots to a session of L tokens copies all L of them, and a tree verify that
keeps a non-contiguous accepted path copies them again. Speculative decoding
appends and rolls back every cycle, so those copies are O(KV) per cycle per
session. A ``SlabLayer`` keeps its keys and values in a buffer
[batch, heads, capacity, head_dim] and exposes the first ``length`` slots:

- ``append``: writes into the spare room, O(new slots); the first allocation
  is the size the caller reserved (a verifier session's worst case), and a
  full buffer grows by half;
- ``truncate``: only moves the length;
- ``keep_path``: committing an accepted tree path moves just the path's slots down
  (``reorder_tail``: the same from the path's indices on the device);
- ``gather_rows`` / ``append_slots``: several sessions' caches copied once
  into a padded batch cache, and a batch row's new slots appended back.

Every layer of a cache from ``new_cache`` is a ``SlabLayer`` holding the whole
sequence, sliding-window layers included: the window is applied by the
attention mask (``specdec.model.masks``), so a truncation or a kept path is the same
operation on every layer and no layer's length bookkeeping can go stale.

Buffers are inference tensors (the forwards run under ``torch.inference_mode``),
so every in-place change runs under it too. ``keys`` / ``values`` read as views
of the used slots; assigning a tensor to them adopts it as the new buffer
(exactly full), which keeps any other transformers code that rebinds them
correct. The operations also work on plain ``DynamicLayer``s (tests compare
against them).
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, get_layer_types_and_kwargs

_ROUND = 64          # capacities are multiples of this many slots
# names a module's forward may take its KV cache under, newest first: transformers renamed
# ``past_key_values`` to ``cache`` (5.24; the old name warns, and goes in 5.40); some blocks say ``layer_past``
CACHE_KEYWORDS = ("cache", "past_key_values", "layer_past")


@functools.cache
def cache_keyword(forward) -> str:
    """The keyword ``forward`` (a module class's forward) takes its KV cache under."""
    params = inspect.signature(forward).parameters
    return next((name for name in CACHE_KEYWORDS if name in params), "past_key_values")


def with_cache(module: torch.nn.Module, cache) -> dict:
    """``{keyword: cache}`` for calling ``module`` with ``cache``, whichever name its transformers version uses."""
    return {cache_keyword(type(module).forward): cache}


def _in_inference_mode(method):
    """Run ``method`` under torch.inference_mode (entered only when it is not already on)."""
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return method(*args, **kwargs)
        with torch.inference_mode():
            return method(*args, **kwargs)
    run.__name__, run.__doc__ = method.__name__, method.__doc__
    return run


def _rounded(n: int) -> int:
    return -(-n // _ROUND) * _ROUND


class SlabLayer(DynamicLayer):
    """A full-attention cache layer over a buffer with spare room (see module doc)."""

    def __init__(self, capacity: int = 0):
        self._reserve = capacity         # first allocation holds at least this many slots
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._len = self._vlen = 0       # used slots (of keys; of values, see below)
        super().__init__()               # sets keys = values = None through the properties

    # -- the views ------------------------------------------------------------------------
    # Keys and values keep their own length only while code rebinds them one
    # after the other (``self.keys = self.keys[...]; self.values = ...``).
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[:, :, :self._len]

    @keys.setter
    def keys(self, t: torch.Tensor | None) -> None:
        self._k = t
        self._len = 0 if t is None or t.dim() < 3 else t.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:, :, :self._vlen]

    @values.setter
    def values(self, t: torch.Tensor | None) -> None:
        self._v = t
        self._vlen = 0 if t is None or t.dim() < 3 else t.shape[-2]

    @property
    def buffers(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The whole key and value buffers [B, heads, capacity, d], spare room included."""
        return self._k, self._v

    @property
    def capacity(self) -> int:
        if self._k is None or self._v is None or self._k.dim() < 3 or self._v.dim() < 3:
            return 0
        return min(self._k.shape[-2], self._v.shape[-2])

    # -- transformers' layer API ------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.append(key_states, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len if self.is_initialized else 0

    # -- in-place surgery -------------------------------------------------------------------
    @_in_inference_mode
    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [B, heads, n, d] after the used slots."""
        if self._k is not None and self._k.shape[0] != k.shape[0]:
            raise ValueError(f"cannot append a batch of {k.shape[0]} rows to a cache of {self._k.shape[0]}")
        end = self._len + k.shape[-2]
        if self._k is None or end > self.capacity:
            self._grow(k, v, end)
        self._k[:, :, self._len:end] = k
        self._v[:, :, self._len:end] = v
        self._len = self._vlen = end

    @_in_inference_mode
    def append_many(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """``append`` each of keys[i], values[i] [B, heads, n_i, d] in turn, the room made once."""
        end = self._len + sum(k.shape[-2] for k in keys)
        if self._k is None or end > self.capacity:
            self._grow(keys[0], values[0], end)
        # one copy per buffer: a slice write costs microseconds of dispatch
        # whatever its size, which dozens of small blocks a layer add up to
        self._k[:, :, self._len:end] = torch.cat(keys, dim=-2) if len(keys) > 1 else keys[0]
        self._v[:, :, self._len:end] = torch.cat(values, dim=-2) if len(values) > 1 else values[0]
        self._len = self._vlen = end

    @_in_inference_mode
    def _grow(self, k: torch.Tensor, v: torch.Tensor, need: int) -> None:
        old = self.capacity
        # the caller's reservation once (exactly: a verifier's KV budget counts it), then by half
        size = max(need, self._reserve) if self._reserve else _rounded(max(need, old + old // 2))
        shape = (k.shape[0], k.shape[1], size, k.shape[3])
        nk, nv = k.new_empty(shape), v.new_empty(v.shape[:2] + (size, v.shape[3]))
        if self._len:
            nk[:, :, :self._len] = self._k[:, :, :self._len]
            nv[:, :, :self._len] = self._v[:, :, :self._len]
        self._k, self._v = nk, nv
        self._reserve = 0

    def adopt(self, k: torch.Tensor, v: torch.Tensor, length: int) -> None:
        """Use k, v [B, heads, capacity, d] as the buffer, the first ``length`` slots filled."""
        if not self.is_initialized:
            self.lazy_initialization(k, v)
        self._k, self._v, self._len, self._vlen = k, v, length, length

    def set_length(self, length: int) -> None:
        if not 0 <= length <= self._len:
            raise ValueError(f"cannot set the length to {length}: {self._len} slots are used")
        self._len = self._vlen = length

    @_in_inference_mode
    def keep_after(self, start: int, slots: torch.Tensor) -> None:
        """Keep slots [0, start) and then ``slots`` (ascending, all >= start), in place."""
        m = slots.numel()
        self._k[:, :, start:start + m] = self._k.index_select(2, slots)
        self._v[:, :, start:start + m] = self._v.index_select(2, slots)
        self._len = self._vlen = start + m

    @_in_inference_mode
    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows``, spare room included."""
        self._k, self._v = self._k.index_select(0, rows), self._v.index_select(0, rows)

    def nbytes(self) -> int:
        """Bytes held, spare room included."""
        if self._k is None:
            return 0
        return self._k.numel() * self._k.element_size() + self._v.numel() * self._v.element_size()


# layer types whose cache is plain keys and values over the whole sequence (the mask does the rest)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_types(config) -> list[str]:
    """transformers' per-layer cache types for ``config`` (its decoder's)."""
    return get_layer_types_and_kwargs(config.get_text_config(decoder=True))[0]


def new_cache(config, capacity: int = 0) -> DynamicCache:
    """A DynamicCache for ``config`` whose layers are all SlabLayers.
    ``capacity``: slots to allocate at the first append (0: just what it needs).
    Raises ValueError for a layer type that is not plain attention (recurrent
    or compressed state cannot be rolled back by dropping slots)."""
    cache = DynamicCache(config=config)
    for kind, layer in zip(layer_types(config), cache.layers):
        if kind not in ATTENTION_LAYER_TYPES or type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
            raise ValueError(f"cache layers of type {kind!r} cannot be rolled back slot by slot")
    cache.layers = [SlabLayer(capacity) for _ in cache.layers]
    return cache


# -- operations on a whole cache -------------------------------------------------------------
def seq_len(cache) -> int:
    """Slots used (every layer holds the same number)."""
    layers = getattr(cache, "layers", [])
    if not layers or getattr(layers[0], "keys", None) is None or layers[0].keys.numel() == 0:
        return 0
    return int(layers[0].keys.shape[2])


def append(cache, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Append slots [B, heads, n, d] to one layer (in place where the layer can)."""
    layer = cache.layers[layer_idx]
    if hasattr(layer, "append") and layer.is_initialized:
        layer.append(keys, values)
    else:
        cache.update(keys, values, layer_idx)


def adopt(cache, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
    """Make [B, heads, capacity, d] buffers, the first ``length`` slots filled,
    one layer's cache: later appends fill the rest in place where the layer
    can; other layers take just the filled slots."""
    layer = cache.layers[layer_idx]
    if hasattr(layer, "adopt"):
        layer.adopt(keys, values, length)
    else:
        cache.update(keys[:, :, :length], values[:, :, :length], layer_idx)


def truncate(cache, length: int) -> None:
    """Drop every slot from ``length`` on, in place (no copy)."""
    for layer in cache.layers:
        if hasattr(layer, "set_length"):
            layer.set_length(length)
        else:
            layer.keys = layer.keys[:, :, :length]
            layer.values = layer.values[:, :, :length]


def keep_path(cache, prefix_len: int, path: list[int]) -> None:
    """After a tree forward appended n slots at ``prefix_len``, keep the prefix
    plus the tree nodes ``path`` (node indices, ascending, root first). A path
    that is already contiguous from the root only needs a truncation."""
    if path == list(range(len(path))):
        truncate(cache, prefix_len + len(path))
        return
    device = cache.layers[0].keys.device
    slots = prefix_len + torch.tensor(path, dtype=torch.long, device=device)
    stack = stacked_buffer(cache)                   # [layers, 2, 1, heads, C, d]
    if stack is not None:
        # a compiled path's stacked buffer: one gather and one copy for every layer's K and V
        with torch.inference_mode():
            stack[:, :, :, :, prefix_len:prefix_len + len(path)] = stack.index_select(4, slots)
        for layer in cache.layers:
            layer.set_length(prefix_len + len(path))
        return
    idx = None
    for layer in cache.layers:
        if hasattr(layer, "keep_after"):
            layer.keep_after(prefix_len, slots)        # moves only the path's slots
        else:
            if idx is None:
                idx = torch.cat([torch.arange(prefix_len, device=device), slots])
            layer.keys = layer.keys.index_select(2, idx)
            layer.values = layer.values.index_select(2, idx)


def reorder_tail(cache, prefix_len: int, order: torch.Tensor) -> None:
    """After a tree forward appended n slots at ``prefix_len``, put them in
    ``order`` ([n] node indices, on the cache's device: the nodes to keep
    first, ``specdec.tree.acceptance.greedy_order``), before the host knows
    how many to keep (``truncate`` then drops the rest). A compiled path's
    stacked buffer: one gather and one copy for every layer's K and V."""
    n = order.shape[0]
    stack = stacked_buffer(cache)
    if stack is not None:
        with torch.inference_mode():
            tail = stack.narrow(4, prefix_len, n)
            tail.copy_(tail.index_select(4, order))
        return
    slots = order + prefix_len
    idx = None
    for layer in cache.layers:
        if hasattr(layer, "keep_after"):
            layer.keep_after(prefix_len, slots)
        else:
            if idx is None:
                idx = torch.cat([torch.arange(prefix_len, device=slots.device), slots])
            layer.keys = layer.keys.index_select(2, idx)
            layer.values = layer.values.index_select(2, idx)


def stacked_buffer(cache) -> torch.Tensor | None:
    """A compiled path's stacked buffer of ``cache`` (``specdec.compile.fixed_kv``),
    while every layer still holds its K and V as views of it; else None."""
    fixed = getattr(cache, "fixed_buffers", None)
    if fixed is None or len(fixed.views) != len(cache.layers):
        return None
    for layer, (k, v) in zip(cache.layers, fixed.views):
        held = getattr(layer, "buffers", (None, None))
        if held[0] is not k or held[1] is not v or not hasattr(layer, "set_length"):
            return None
    return fixed.stack


def select_rows(cache, rows: torch.Tensor) -> None:
    """Keep batch rows ``rows`` of every layer."""
    for layer in cache.layers:
        if hasattr(layer, "select_rows"):
            layer.select_rows(rows)
        else:
            layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)


def gather_rows(batch, caches: list, lengths: list[int], width: int, room: int) -> None:
    """Fill the empty cache ``batch`` with one row per cache of ``caches``
    (each one row): row b holds ``caches[b]``'s first ``lengths[b]`` slots, then
    zeros up to ``width`` (padding: masked, but never NaN), then ``room`` spare
    slots that later forwards write in place. One copy of every prefix."""
    ref = next((c for c, n in zip(caches, lengths) if n > 0), None)
    if ref is None:
        return                                   # nothing to copy: the first forward fills it
    for layer_idx, ref_layer in enumerate(ref.layers):
        k0, v0 = ref_layer.keys, ref_layer.values                       # [1, heads, n, d]
        ks = k0.new_empty(len(caches), k0.shape[1], width + room, k0.shape[3])
        vs = v0.new_empty(len(caches), v0.shape[1], width + room, v0.shape[3])
        for b, (cache, n) in enumerate(zip(caches, lengths)):
            if n:
                ks[b, :, :n] = cache.layers[layer_idx].keys[0, :, :n]
                vs[b, :, :n] = cache.layers[layer_idx].values[0, :, :n]
            ks[b, :, n:width] = 0
            vs[b, :, n:width] = 0
        adopt(batch, layer_idx, ks, vs, width)


def append_slots(cache, batch, row: int, slots: torch.Tensor) -> None:
    """Append batch row ``row``'s slots ``slots`` ([m] int64) of ``batch`` to ``cache``, every layer."""
    for layer_idx, layer in enumerate(batch.layers):
        append(cache, layer_idx, layer.keys[row:row + 1, :, slots], layer.values[row:row + 1, :, slots])


def nbytes(cache) -> int:
    """Bytes the cache holds (spare room of in-place layers included)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        if hasattr(layer, "nbytes"):
            total += layer.nbytes()
        elif getattr(layer, "keys", None) is not None:
            total += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
    return total


# -- prefix caching (``specdec.model.prefix_cache``) ------------------------------------------
@_in_inference_mode
def copy_slots(cache, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A copy of slots [start, end) of every layer: [(keys, values) [B, heads, end - start, d]]."""
    return [(layer.keys[:, :, start:end].clone(), layer.values[:, :, start:end].clone()) for layer in cache.layers]


@_in_inference_mode
def append_blocks(cache, blocks: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
    """Append ``copy_slots`` blocks, in order, to every layer: each block copied
    once, straight into a ``SlabLayer``'s buffer (grown once)."""
    for layer_idx in range(len(blocks[0]) if blocks else 0):
        layer = cache.layers[layer_idx]
        if hasattr(layer, "append_many"):
            if not layer.is_initialized:
                layer.lazy_initialization(*blocks[0][layer_idx])
            layer.append_many([b[layer_idx][0] for b in blocks], [b[layer_idx][1] for b in blocks])
        else:
            for block in blocks:
                append(cache, layer_idx, *block[layer_idx])


def slots_nbytes(slots: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in slots)
