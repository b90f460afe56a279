"""KV caches that grow in place: transformers' ``DynamicCache`` with layers
backed by a buffer that has spare room.

transformers' ``DynamicLayer`` concatenates on every update, so appending n
slots to a session of L tokens copies all L of them, and a tree verify that
keeps a non-contiguous accepted path copies them again. Speculative decoding
appends and rolls back every cycle, so those copies are O(KV) per cycle per
session. A ``SlabLayer`` keeps its keys and values in a buffer
[batch, heads, capacity, head_dim] and exposes the first ``length`` slots:

- an append writes into the spare room, O(new slots); the first allocation
  is the size the caller reserved (a verifier session's worst case), and a
  full buffer grows by half;
- a truncation only moves the length;
- committing an accepted tree path moves just the path's slots down.

Buffers are inference tensors (the forwards run under ``torch.inference_mode``),
so every in-place change runs under it too.

``keys`` / ``values`` read as views of the used slots, so attention and the
helpers in ``specdec.kv`` work unchanged; assigning a tensor to them adopts it
as the new buffer (exactly full), which keeps any other transformers code
that rebinds them correct.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

_ROUND = 64          # capacities are multiples of this many slots


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


def new_cache(config, capacity: int = 0) -> DynamicCache:
    """A DynamicCache for ``config`` whose full-attention layers are SlabLayers
    (sliding-window and other special layers stay transformers' own).
    ``capacity``: slots to allocate at the first append (0: just what it needs)."""
    cache = DynamicCache(config=config)
    cache.layers = [SlabLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
