"""The fixed-shape KV view compiled forwards run over (``specdec.compile.forwards``,
``drafter.compiled.head_levels``): one stacked buffer [layers, 2, 1, heads, C, d]
that a session's in-place cache layers (``specdec.model.kv.SlabLayer``) view into,
the cache layer a traced forward writes it through, and the additive masks
padded to the buffer's capacity."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from specdec.model import kv


class FixedLayer(CacheLayerMixin):
    """Layer ``index`` of a stacked cache [layers, 2, 1, heads, C, d] inside a
    compiled forward: ``update`` writes the new K/V at ``slots`` [n] and
    returns the layer's whole buffers [1, heads, C, d].

    The write indexes the stacked buffer itself (an ``index_put_`` on the graph
    input), not a per-layer view of it: a write through a view of an input is
    replayed by the compiler as a copy of the whole buffer, every layer."""

    is_compileable = True

    def __init__(self, stack: torch.Tensor, index: int, slots: torch.Tensor):
        super().__init__()
        self.stack, self.slots = stack, slots
        self.keys, self.values = stack[index, 0], stack[index, 1]
        self.layer = torch.full((1,), index, dtype=torch.long, device=stack.device)
        self.kv = torch.arange(2, device=stack.device)[:, None]       # [2, 1]: K, V rows
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states [1, heads, n, d] -> [2, n, 1, heads, d], the indexed dims first
        new = torch.stack([key_states, value_states]).permute(0, 3, 1, 2, 4)
        self.stack[self.layer, self.kv, :, :, self.slots] = new
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.keys.shape[2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]


def pad_mask(mask: torch.Tensor, width: int, capacity: int) -> torch.Tensor:
    """An additive mask [B, 1, n, L + n] as [B, 1, width, capacity]: unseen
    slots get the dtype's minimum; pad query j (j >= n) sees only slot L + j."""
    B, _, n, k = mask.shape
    out = mask.new_full((B, 1, width, capacity), torch.finfo(mask.dtype).min)
    out[:, :, :n, :k] = mask
    pads = torch.arange(n, width)
    out[:, :, pads, k - n + pads] = 0
    return out


def padded(mask, width: int, capacity: int):
    """``pad_mask`` of a model's mask, one tensor or one per layer type."""
    if isinstance(mask, dict):
        return {kind: pad_mask(m, width, capacity) for kind, m in mask.items()}
    return pad_mask(mask, width, capacity)


@dataclass(frozen=True)
class FixedBuffers:
    """A compiled-path cache's one buffer and the per-layer (K, V) views its SlabLayers hold."""

    stack: torch.Tensor                              # [layers, 2, 1, heads, C, d]
    views: list[tuple[torch.Tensor, torch.Tensor]]


def cache_shape(cache) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a filled cache; every layer must agree (one stacked buffer)."""
    shapes = {(layer.keys.shape[1], layer.keys.shape[3]) for layer in cache.layers}
    if len(shapes) != 1:
        raise ValueError(f"layers differ in K/V shape {sorted(shapes)}: no one stacked buffer")
    (heads, dim), = shapes
    return len(cache.layers), heads, dim


def fixed_buffers(cache) -> FixedBuffers | None:
    """The stacked buffer of a cache from ``CompiledForward.new_cache``, while
    every layer still holds its view (a grown or re-batched layer does not)."""
    fixed = getattr(cache, "fixed_buffers", None)
    layers = getattr(cache, "layers", None)
    if fixed is None or not layers or len(layers) != len(fixed.views):
        return None
    for layer, (k, v) in zip(layers, fixed.views):
        held = getattr(layer, "buffers", (None, None))
        if held[0] is not k or held[1] is not v:
            return None
    return fixed


def stacked_cache(cache, stack: torch.Tensor, length: int = 0):
    """Make ``cache`` (SlabLayers) a compiled-path cache over ``stack``
    [layers, 2, 1, heads, C, d], every layer a view into it, its first
    ``length`` slots filled."""
    views = [(stack[i, 0], stack[i, 1]) for i in range(stack.shape[0])]
    for i, (k, v) in enumerate(views):
        kv.adopt(cache, i, k, v, length)
    cache.fixed_buffers = FixedBuffers(stack, views)
    return cache
