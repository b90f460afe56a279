"""KV-cache surgery and tree attention masks, shared by the verifier and drafters.

Works on any cache whose ``layers`` carry ``keys``/``values`` tensors of shape
[B, heads, seq, head_dim] (transformers' ``DynamicCache``), without importing
transformers. Rollback is a gather along the sequence axis: keep the committed
prefix plus the accepted tree slots, in order, and drop the rest.
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
    """Drop every slot from ``length`` on, in place (a view: no copy)."""
    for layer in cache.layers:
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
    idx = torch.cat([torch.arange(prefix_len, device=device),
                     prefix_len + torch.tensor(path, dtype=torch.long, device=device)])
    keep(cache, idx)


def nbytes(cache) -> int:
    return sum(layer.keys.numel() * layer.keys.element_size()
               + layer.values.numel() * layer.values.element_size()
               for layer in getattr(cache, "layers", []) if getattr(layer, "keys", None) is not None)


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
