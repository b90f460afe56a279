"""ALiBi under a draft tree: Falcon-RW (``alibi=True``), BLOOM and MPT.

ALiBi (Press et al., "Train Short, Test Long", arXiv:2108.12409) adds no
position embedding; each head h adds ``-slope_h * (q - k)`` to the score of a
query at position q for a key at position k. Within one query's softmax the
``-slope_h * q`` part is a constant, so every implementation transformers ships
adds just a per-key bias ``slope_h * k`` (MPT: ``slope_h * (k - last)``), one row
[heads, keys] for every query.

transformers builds that row from key *slots*: ``arange(kv_length)`` or the
cumulative sum of a 2-D padding mask. Under a draft tree slots are not
positions (siblings share a depth, hence a position), and none of the three
models accepts specdec's 4-D tree mask anyway. So for a forward with an
explicit mask specdec runs the model's decoder blocks itself, the way the
model's own forward does, with two changes:

- the bias row is the model's own ALiBi table (built by the model's own
  builder, so its rounding is the model's) gathered at each key slot's token
  *position*: ``bias[b, h, j] = table[h, key_positions[b, j]]``. Siblings at one
  depth get the same bias; a padded batch row gets its own positions;
- the causality is specdec's ``allowed`` [B, q, k] (prefix, ancestors, itself),
  in the form each family's blocks take: BLOOM an additive [B, 1, q, k] mask
  beside a [B * heads, 1, k] alibi; Falcon additionally folds ``alibi / sqrt(d)``
  into a [B, heads, q, k] mask exactly as ``FalconModel`` does (its eager
  attention adds both, its SDPA attention only the mask); MPT a per-row bias
  its attention cannot take (it wants one [heads, q, k] bias for the whole
  batch), so the MPT attention is computed here, op for op as ``MptAttention``.

A forward without a mask (prefill, feeding committed tokens) is causal after
a cache whose slot i holds position i: there the model's own forward is exact
and is used. ``specdec.model.causal_lm.check_servable`` proves the tree path against
the model's own plain forwards at load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.models.falcon.modeling_falcon import (
    build_alibi_tensor as falcon_alibi_tensor,
)

from specdec.model import kv
from specdec.model.masks import additive


def uses_alibi(config) -> bool:
    """Whether ``config`` is one of transformers' ALiBi causal LMs."""
    kind = getattr(config, "model_type", "")
    return kind in ("bloom", "mpt") or (kind == "falcon" and bool(getattr(config, "alibi", False)))


@dataclass(frozen=True)
class AlibiMask:
    """The ``attention_mask`` of an ALiBi model's forward: who sees whom and
    the bias of every key slot from its token position."""

    allowed: torch.Tensor        # bool [B, q, k]
    bias: torch.Tensor           # [B, heads, k], the model's own ALiBi values at the key positions


class AlibiStack:
    """An ALiBi model's decoder stack run with position biases (module doc).
    Subclasses say how the family builds its table and feeds its blocks."""

    def __init__(self, body: torch.nn.Module, dtype: torch.dtype):
        self.body, self.dtype = body, dtype
        self.heads = int(body.num_heads)

    def table(self, length: int, device: torch.device) -> torch.Tensor:
        """[heads, length]: the bias the model gives a key at each position 0..length-1."""
        raise NotImplementedError

    def mask(self, allowed: torch.Tensor, key_positions: torch.Tensor) -> AlibiMask:
        """allowed [B, q, k] bool, key_positions [B, k]: the positions of the tokens in the key slots."""
        device = next(self.body.parameters()).device
        key_positions = key_positions.to(device)
        table = self.table(int(key_positions.max()) + 1, device)                 # [heads, L]
        return AlibiMask(allowed.to(device), table[:, key_positions].permute(1, 0, 2))

    def hidden(self, cache, tokens: torch.Tensor, positions: torch.Tensor, mask: AlibiMask) -> torch.Tensor:
        """tokens, positions [B, n] appended to ``cache`` -> final hidden states [B, n, H]."""
        raise NotImplementedError


class FalconAlibi(AlibiStack):
    """``FalconModel`` with ``alibi=True`` (Falcon-RW)."""

    def table(self, length, device):
        ones = torch.ones(1, length, dtype=torch.long, device=device)
        return falcon_alibi_tensor(ones, self.heads, dtype=self.dtype)[:, 0]

    def hidden(self, cache, tokens, positions, mask):
        B, q, k = mask.allowed.shape
        alibi = mask.bias.reshape(B * self.heads, 1, k)
        head_dim = self.body.config.hidden_size // self.heads
        # FalconModel: the causal mask becomes alibi / sqrt(head_dim) where allowed, the minimum elsewhere
        folded = (mask.bias[:, :, None, :] / math.sqrt(head_dim)).expand(B, self.heads, q, k)
        folded = folded.masked_fill(~mask.allowed[:, None], torch.finfo(self.dtype).min)     # [B, heads, q, k]
        h = self.body.word_embeddings(tokens)
        for block in self.body.h:
            h = block(h, alibi=alibi, attention_mask=folded, position_ids=positions, use_cache=True,
                      position_embeddings=None, **kv.with_cache(block, cache))[0]
        return self.body.ln_f(h)


class BloomAlibi(AlibiStack):
    """``BloomModel``."""

    def table(self, length, device):
        ones = torch.ones(1, length, dtype=torch.long, device=device)
        return self.body.build_alibi_tensor(ones, self.heads, dtype=self.dtype)[:, 0]

    def hidden(self, cache, tokens, positions, mask):
        B, _, k = mask.allowed.shape
        alibi = mask.bias.reshape(B * self.heads, 1, k)
        causal = additive(mask.allowed, self.dtype)[:, None]                      # [B, 1, q, k]
        h = self.body.word_embeddings_layernorm(self.body.word_embeddings(tokens))
        for block in self.body.h:
            h = block(h, alibi=alibi, attention_mask=causal, use_cache=True, **kv.with_cache(block, cache))[0]
        return self.body.ln_f(h)


class MptAlibi(AlibiStack):
    """``MptModel``: its blocks, with the attention computed by ``mpt_attention``."""

    def table(self, length, device):
        # [heads, 1, length], float32 whatever the model's dtype, as MptModel builds it
        return self.body.build_mpt_alibi_tensor(self.heads, length, device=device)[:, 0]

    def hidden(self, cache, tokens, positions, mask):
        h = self.body.wte(tokens)
        for block in self.body.blocks:                       # MptBlock.forward, with the attention below
            attn = mpt_attention(block.attn, block.norm_1(h), mask, cache)
            h = block.resid_attn_dropout(attn) + h
            h = block.ffn(block.norm_2(h), h)                # adds its residual itself
        return self.body.norm_f(h)


def mpt_attention(attn: torch.nn.Module, x: torch.Tensor, mask: AlibiMask, cache) -> torch.Tensor:
    """``MptAttention.forward`` with a per-row position bias: x [B, n, H] -> [B, n, H]."""
    B, n, _ = x.shape
    qkv = attn.Wqkv(x)
    if attn.clip_qkv:
        qkv = qkv.clamp(min=-attn.clip_qkv, max=attn.clip_qkv)
    q, k, v = (t.reshape(B, n, attn.n_heads, attn.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=2))
    k, v = cache.update(k, v, attn.layer_idx)                                    # [B, heads, keys, d]
    scores = torch.matmul(q, k.transpose(-1, -2)) * attn.softmax_scale + mask.bias[:, :, None, :]
    scores = scores.masked_fill(~mask.allowed[:, None], torch.finfo(q.dtype).min)
    weights = torch.nn.functional.softmax(scores.float(), dim=-1).to(v.dtype)
    weights = torch.nn.functional.dropout(weights, p=attn.attn_dropout_p, training=attn.training)
    out = torch.matmul(weights, v).permute(0, 2, 1, 3).reshape(B, n, -1)
    return attn.out_proj(out)


STACKS = {"falcon": FalconAlibi, "bloom": BloomAlibi, "mpt": MptAlibi}


def alibi_stack(model) -> AlibiStack | None:
    """The ALiBi runner for a loaded ``*ForCausalLM``, or None when it does not use ALiBi."""
    if not uses_alibi(model.config):
        return None
    return STACKS[model.config.model_type](model.get_decoder(), next(model.parameters()).dtype)
