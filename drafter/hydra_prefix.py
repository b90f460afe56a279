"""Hydra++'s prefix layer (the "prefix-mlp" head arch) and its reference layout.

Reference: zankner/Hydra, ``hydra/model/hydra_heads/prefix_mlp_head.py``. One
extra decoder layer, built like the target's own (a one-layer ``LlamaModel``
of the target's config: its width, attention and KV heads, MLP width, rope,
and a final norm), runs causally over the target's final-norm hidden states
h_0 .. h_t of the whole context, with its own KV cache. Its output at t takes
the place of h_t in the heads' input: head i reads concat(P(h)_t, E(root),
E(x_1), .., E(x_i)); the base hidden state is not kept beside it.

Reference keys (``hydra_lm_head.pt``: the state dict of ``HydraPrefixMLP``):
``prefix_embeding_layer.layers.0.self_attn.{q,k,v,o}_proj.weight``,
``prefix_embeding_layer.layers.0.mlp.{gate,up,down}_proj.weight``,
``prefix_embeding_layer.layers.0.{input,post_attention}_layernorm.weight``,
``prefix_embeding_layer.norm.weight`` (its unused ``embed_tokens.weight`` and
rotary ``inv_freq`` are allowed and ignored); the heads' blocks sit between
dropouts, ``hydra_mlp.{i}.{2l + 1}.*``, and the vocabulary projections after
one, ``hydra_lm_head.{i}.1.weight|bias``. ``to_reference``/``from_reference``
map those onto ``drafter.hydra_heads.HydraHeads``' own names.

A session's prefix KV holds the layer's keys and values of its committed
hidden states only: ``feed`` appends the pending ones (several sessions in one
padded forward), and the drafter's rollback truncates it like any model
drafter's cache (``drafter.base.Drafter.rollback``).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from specdec.model import kv, masks
from drafter.eagle.eagle2_head import head_config, head_config_for

REFERENCE = "prefix_embeding_layer."
# the target config's fields that shape or change the layer besides head_config_for's
_TARGET_FIELDS = ("head_dim", "rope_parameters", "rope_theta", "rope_scaling", "attention_bias", "mlp_bias",
                  "hidden_act")
_IGNORED = re.compile(r"prefix_embeding_layer\.(embed_tokens\.weight|layers\.0\.self_attn\.rotary_emb\.inv_freq)")
_MLP = re.compile(r"hydra_mlp\.(\d+)\.(\d+)\.(.+)")
_LM = re.compile(r"hydra_lm_head\.(\d+)\.1\.(weight|bias)")


def prefix_config(target_config):
    """The prefix layer's config: the target's decoder layer, one of it."""
    text = target_config.get_text_config(decoder=True)
    fields = head_config_for(target_config)
    for name in _TARGET_FIELDS:
        if getattr(text, name, None) is not None:
            fields[name] = getattr(text, name)
    return head_config(fields)


class PrefixLayer(nn.Module):
    """One Llama decoder layer and a final norm over the target's hidden states."""

    def __init__(self, config):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, layer_idx=0)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None,
                cache=None) -> torch.Tensor:
        """hidden [B, n, H] (the target's), positions [B, n]; mask additive
        [B, 1, n, past + n] or None (causal). Returns the layer's output [B, n, H]."""
        x = hidden.to(self.norm.weight.dtype)
        past = kv.seq_len(cache) if cache is not None else 0
        if mask is None and x.shape[1] > 1:
            mask = masks.causal_mask(x.shape[1], past, x.dtype).to(x.device)   # SDPA's own is top-left aligned
        pe = self.rotary(x, positions)
        layer = self.layers[0]
        out = layer(x, attention_mask=mask, position_ids=positions, use_cache=cache is not None,
                    position_embeddings=pe, **kv.with_cache(layer, cache))
        return self.norm(out[0] if isinstance(out, tuple) else out)


def from_reference(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A prefix-mlp checkpoint's keys under ``HydraHeads``' names (``prefix.*``,
    ``hydra_mlp.{i}.{l}.*``, ``hydra_lm_head.{i}.*``); keys that fit neither
    layout are kept as they are (the loader names them)."""
    out = {}
    for key, value in state.items():
        if _IGNORED.fullmatch(key):
            continue
        mlp, lm = _MLP.fullmatch(key), _LM.fullmatch(key)
        if key.startswith(REFERENCE):
            key = "prefix." + key.removeprefix(REFERENCE)
        elif mlp and int(mlp[2]) % 2 == 1:
            key = f"hydra_mlp.{mlp[1]}.{int(mlp[2]) // 2}.{mlp[3]}"
        elif lm:
            key = f"hydra_lm_head.{lm[1]}.{lm[2]}"
        else:
            key = "?" + key                  # no reference key: reported as it was named
        out[key] = value
    return out


def to_reference(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``HydraHeads``' state of prefix-mlp heads under the reference keys."""
    out = {}
    for key, value in state.items():
        mlp = _MLP.fullmatch(key)
        if key.startswith("prefix."):
            key = REFERENCE + key.removeprefix("prefix.")
        elif mlp:
            key = f"hydra_mlp.{mlp[1]}.{2 * int(mlp[2]) + 1}.{mlp[3]}"
        else:
            key = re.sub(r"^hydra_lm_head\.(\d+)\.", r"hydra_lm_head.\1.1.", key)
        out[key] = value
    return out


def reference_name(key: str) -> str:
    """The reference key a ``from_reference`` key came from."""
    return key[1:] if key.startswith("?") else next(iter(to_reference({key: None})))


@torch.inference_mode()
def feed(layer: PrefixLayer, sessions: list, new_cache) -> None:
    """Append each session's pending hidden states (``sess.features[sess.fed:]``)
    to its own prefix KV in one padded forward, and set its ``root_out`` to
    (the layer's output at its last hidden state [H] fp32, None).

    Row b of the batch cache holds session b's old slots [0, p_b), padding up
    to P, then its m_b new inputs at [P, P + m_b); input i of row b sees
    [0, p_b) and [P, P + i]. A session whose last hidden state was already fed
    re-feeds it (a rollback left no output for it)."""
    dev = layer.norm.weight.device
    for sess in sessions:
        if sess.cache is None:
            sess.cache = new_cache()
        if sess.fed >= len(sess.features):
            sess.fed = len(sess.features) - 1
            kv.truncate(sess.cache, sess.fed)
    prefixes = [kv.seq_len(s.cache) for s in sessions]
    counts = [len(s.features) - s.fed for s in sessions]
    B, P, M = len(sessions), max(prefixes), max(counts)
    batch = new_cache()
    kv.gather_rows(batch, [s.cache for s in sessions], prefixes, P, M)
    hidden = torch.zeros(B, M, layer.config.hidden_size)
    positions = torch.zeros(B, M, dtype=torch.long)
    allowed = torch.zeros(B, M, P + M, dtype=torch.bool)
    causal = torch.ones(M, M, dtype=torch.bool).tril()
    for b, (sess, p, m) in enumerate(zip(sessions, prefixes, counts)):
        hidden[b, :m] = torch.stack(sess.features[sess.fed:])
        positions[b, :m] = torch.arange(sess.fed, sess.fed + m)
        allowed[b, :m, :p] = True
        allowed[b, :, P:] = causal       # padding rows see themselves: no softmax row is empty
    mask = masks.additive(allowed, layer.norm.weight.dtype)[:, None].to(dev)
    out = layer(hidden.to(dev), positions.to(dev), mask, batch)
    for b, (sess, m) in enumerate(zip(sessions, counts)):
        kv.append_slots(sess.cache, batch, b, torch.arange(P, P + m, device=dev))
        sess.fed += m
        sess.root_out = (out[b, m - 1].float().cpu(), None)
