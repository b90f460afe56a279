"""The attention every specdec model runs: transformers' SDPA, minus one copy.

For a grouped-query model (fewer KV heads than query heads) transformers'
SDPA path repeats the keys and values to the query heads (``repeat_kv``)
whenever more than one query token comes with a mask, which is every draft
tree: a copy of the whole KV cache per layer per forward. PyTorch's SDPA takes
grouped heads itself (``enable_gqa``); on CPU that computes the same numbers
without the copy, in about half the time at the demo family's shapes.
transformers uses it only without a mask, because CUDA's fused kernels then
fall back to the math kernel, so here it is used on CPU only and everything
else goes to transformers' own function.

``IMPLEMENTATION`` is registered with transformers' attention and mask
interfaces on import. ``choose_implementation`` picks, per model class, what a
user's choice loads: this fast path where the model goes through
transformers' attention interface, else the best the model supports (its own
SDPA, or eager where it must: Gemma-2's attention soft-capping, for one).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

IMPLEMENTATION = "specdec_sdpa"


def sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa_attention_forward``, with grouped KV heads left to
    SDPA on CPU. query [B, H, q, d], key/value [B, H_kv, k, d] -> ([B, q, H, d], None)."""
    groups = getattr(module, "num_key_value_groups", 1)
    if (groups == 1 or query.shape[2] == 1 or query.device.type != "cpu"
            or any(kwargs.get(name) is not None for name in ("position_bias", "cache", "softcap"))
            or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal and attention_mask is None)          # query length > 1 here
    if causal and key.shape[2] > query.shape[2]:
        # SDPA aligns is_causal top-left; only an empty cache (prefill) lines up
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal,
        enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def choose_implementation(model_class, requested: str = "auto") -> str:
    """The ``attn_implementation`` to load ``model_class`` (a ``PreTrainedModel``
    subclass) with for the user's ``requested`` choice (``specdec.model.loading.ATTN_IMPLEMENTATIONS``);
    ValueError naming the model and the reason when that choice cannot serve it."""
    if requested == "eager":
        return "eager"
    if requested not in ("auto", "sdpa"):
        raise ValueError(f"unknown attention implementation {requested!r}")
    if not getattr(model_class, "_supports_sdpa", False):
        if requested == "sdpa":
            raise ValueError(f"{model_class.__name__} has no SDPA attention in transformers "
                             f"(use --attn-implementation eager or auto)")
        return "eager"
    # models that dispatch through AttentionInterface can take the registered function
    return IMPLEMENTATION if getattr(model_class, "_supports_attention_backend", False) else "sdpa"


AttentionInterface.register(IMPLEMENTATION, sdpa_forward)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
