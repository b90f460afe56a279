"""KV-cache surgery and tree attention masks, shared by the verifier and drafters.

Works on any cache whose ``layers`` carry ``keys``/``values`` tensors of shape
[B, heads, seq, head_dim] (transformers' ``DynamicCache``), without importing
transformers. Rollback is a gather along the sequence axis: keep the committed
prefix plus the accepted tree slots, in order, and drop the rest. Layers that
grow in place (``specdec.kvcache.SlabLayer``) do it without copying the prefix.
"""

from __future__ import annotations

import torch


def seq_len(cache) -> int:
    layers = getattr(cache, "layers", [])
    if not layers or getattr(layers[0], "keys", None) is None or layers[0].keys.numel() == 0:
        return 0
    return int(layers[0].keys.shape[2])


def keep(cache, indices: torch.Tensor) -> None:
    """Keep only sequence slots ``indices`` ([m] int64, ascending), in place."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(2, indices)
        layer.values = layer.values.index_select(2, indices)


def truncate(cache, length: int) -> None:
    """Drop every slot from ``length`` on, in place (no copy)."""
    for layer in cache.layers:
        if hasattr(layer, "set_length"):
            layer.set_length(length)
        else:
            layer.keys = layer.keys[:, :, :length]
            layer.values = layer.values[:, :, :length]


def commit_path(cache, prefix_len: int, path: list[int]) -> None:
    """After a tree forward appended n slots at ``prefix_len``, keep the prefix
    plus the tree nodes ``path`` (node indices, root first). A path that is
    already contiguous from the root only needs a truncation."""
    if path == list(range(len(path))):
        truncate(cache, prefix_len + len(path))
        return
    device = cache.layers[0].keys.device
    slots = prefix_len + torch.tensor(path, dtype=torch.long, device=device)
    idx = None
    for layer in cache.layers:
        if hasattr(layer, "keep_after"):
            layer.keep_after(prefix_len, slots)        # moves only the path's slots
        else:
            if idx is None:
                idx = torch.cat([torch.arange(prefix_len, device=device), slots])
            layer.keys = layer.keys.index_select(2, idx)
            layer.values = layer.values.index_select(2, idx)


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


def select_rows(cache, rows: torch.Tensor) -> None:
    """Keep batch rows ``rows`` of every layer."""
    for layer in cache.layers:
        if hasattr(layer, "select_rows"):
            layer.select_rows(rows)
        else:
            layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)


def nbytes(cache) -> int:
    """Bytes the cache holds (spare room of in-place layers included)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        if hasattr(layer, "nbytes"):
            total += layer.nbytes()
        elif getattr(layer, "keys", None) is not None:
            total += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
    return total


def tree_attention_mask(ancestor: torch.Tensor, prefix_len: int, dtype=torch.float32) -> torch.Tensor:
    """Additive 4-D mask [1, 1, n, prefix_len + n]: every node sees the whole
    committed prefix, itself and its ancestors (``ancestor`` [n, n] bool).

    A float mask, not a boolean one: transformers' eager attention silently
    misreads a 4-D boolean mask (see DESIGN.md §3)."""
    n = ancestor.shape[0]
    allowed = torch.cat([torch.ones(n, prefix_len, dtype=torch.bool, device=ancestor.device), ancestor], dim=1)
    mask = torch.zeros(n, prefix_len + n, dtype=dtype, device=ancestor.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def causal_mask(n: int, past: int, dtype=torch.float32) -> torch.Tensor:
    """Additive [1, 1, n, past + n] mask: n new tokens after ``past`` cached ones."""
    allowed = torch.ones(n, past + n, dtype=torch.bool).tril(diagonal=past)
    mask = torch.zeros(n, past + n, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
