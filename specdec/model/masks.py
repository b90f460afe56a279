"""Attention masks for tree and batched forwards, for every attention layout
transformers ships in causal LMs.

Every forward specdec runs over a cache says, per query and key slot, whether
the query may see the key (``allowed``, bool [B, q, k]): the committed prefix,
the query's tree ancestors and itself. Models take that as an *additive* mask
(0 where allowed, the dtype's minimum elsewhere); ``additive`` is the one place
that conversion happens. A float mask, not a boolean one: transformers' eager
attention silently misreads a 4-D boolean mask (DESIGN.md §3).

A 4-D mask bypasses a model's own mask building, so whatever the model's
layers would add to causality must be in it. Sliding-window layers: a query at
position p sees a key at position q only when p - q < window (transformers'
``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``). In a tree,
positions are not slots (siblings share a position), so the window is applied
to the tokens' positions, given per slot. A model whose layers differ (Gemma-2/3,
Qwen2/3 with ``max_window_layers``) takes a dict keyed by layer type, as its own
``create_causal_mask`` / ``create_sliding_window_causal_mask`` calls would build.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FULL = "full_attention"
SLIDING = "sliding_attention"


def additive(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The additive mask for a boolean one: 0 where ``allowed``, the dtype's minimum elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def tree_allowed(ancestor: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """bool [n, prefix_len + n]: every node sees the whole committed prefix,
    itself and its ancestors (``ancestor`` [n, n] bool)."""
    n = ancestor.shape[0]
    prefix = torch.ones(n, prefix_len, dtype=torch.bool, device=ancestor.device)
    return torch.cat([prefix, ancestor], dim=1)


def causal_allowed(n: int, past: int) -> torch.Tensor:
    """bool [n, past + n]: n new tokens after ``past`` cached ones."""
    return torch.ones(n, past + n, dtype=torch.bool).tril(diagonal=past)


def tree_attention_mask(ancestor: torch.Tensor, prefix_len: int, dtype=torch.float32) -> torch.Tensor:
    """Additive [1, 1, n, prefix_len + n] tree mask for a model with full attention only."""
    return additive(tree_allowed(ancestor, prefix_len), dtype)[None, None]


def causal_mask(n: int, past: int, dtype=torch.float32) -> torch.Tensor:
    """Additive [1, 1, n, past + n] mask: n new tokens after ``past`` cached ones."""
    return additive(causal_allowed(n, past), dtype)[None, None]


@dataclass(frozen=True)
class AttentionLayout:
    """What each layer of a model attends to: ``FULL`` or ``SLIDING`` per layer,
    and the window of the sliding ones."""

    layer_types: tuple[str, ...]
    window: int | None = None

    @property
    def windowed(self) -> bool:
        return SLIDING in self.layer_types

    @property
    def mixed(self) -> bool:
        return len(set(self.layer_types)) > 1

    def masks(self, allowed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
              dtype: torch.dtype = torch.float32):
        """The ``attention_mask`` argument for a forward: allowed [B, q, k] bool,
        q_pos [B, q] and k_pos [B, k] the positions of the query tokens and of
        the tokens in the key slots. One additive [B, 1, q, k] tensor when every
        layer attends alike, else a dict keyed by layer type."""
        full = additive(allowed, dtype)[:, None]
        if not self.windowed:
            return full
        near = q_pos[:, :, None] - k_pos[:, None, :] < self.window          # [B, q, k]
        sliding = additive(allowed & near, dtype)[:, None]
        if not self.mixed:
            return sliding
        return {FULL: full, SLIDING: sliding}

    def tree_masks(self, ancestor: torch.Tensor, prefix_len: int, positions: torch.Tensor,
                   dtype: torch.dtype = torch.float32):
        """``masks`` for one tree (ancestor [n, n] bool, node positions [n]) over
        a prefix whose slot i holds position i."""
        k_pos = torch.cat([torch.arange(prefix_len, device=positions.device), positions])
        return self.masks(tree_allowed(ancestor, prefix_len)[None], positions[None], k_pos[None], dtype)

    def bits_masks(self, seen: torch.Tensor, bits: torch.Tensor, positions: torch.Tensor, past: int, n: int,
                   capacity: int, dtype: torch.dtype = torch.float32):
        """``masks`` of a tree forward padded to a compiled step's shape
        [1, 1, w, capacity] (``specdec.compile.fixed_kv.padded``), built where
        its inputs are (the device) from a placed tree's bit sets
        (``specdec.tree.placed``): seen [w] int64, bit j of row i set where
        query i sees slot ``past + j``; bits [w] int64, ``1 << j``; positions
        [w] the queries' positions. Rows below ``n`` also see the ``past``
        cached slots (slot i holds position i); a pad row sees its own slot only."""
        w, low = seen.shape[0], torch.finfo(dtype).min
        full = torch.full((1, 1, w, capacity), low, dtype=dtype, device=seen.device)
        if past:
            full[0, 0, :n, :past] = 0
        full[0, 0, :, past:past + w].masked_fill_((seen[:, None] & bits) != 0, 0)
        if not self.windowed:
            return full
        k_pos = torch.arange(capacity, device=seen.device)
        k_pos[past:past + w] = positions
        sliding = full.masked_fill(positions[:, None] - k_pos >= self.window, low)
        if not self.mixed:
            return sliding
        return {FULL: full, SLIDING: sliding}
