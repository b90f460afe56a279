"""The on-disk layouts of EAGLE-3 heads, read into one form: pure dict work, no torch modules.

Two layouts are in use for the same weights:

- **reference** (the EAGLE authors' ``cnets.py``, also what SpecForge writes):
  config.json is a LlamaConfig plus ``draft_vocab_size`` (and
  ``target_hidden_size`` when the head is narrower than its target); the
  decoder layer's tensors are named ``midlayer.*``. The residual around the
  attention is the un-normed input feature (``norm_before_residual`` false).
- **speculators / vLLM**: config.json has ``speculators_model_type: "eagle3"``
  and the Llama fields under ``transformer_layer_config``; the layer's tensors
  are named ``layers.0.*``. ``norm_before_residual`` defaults to true there
  (vLLM's reading of such a config), so the residual is the normed feature.

Everything else is shared: ``fc.weight``, ``norm.weight``, ``lm_head.weight``,
``d2t`` (draft id -> target id offset), ``t2d`` (target-vocab mask) and an
optional ``embed_tokens.weight``.

Which target layers feed the head (``feature_layers``), always returned as
HF ``output_hidden_states`` indices (index i = the residual stream entering
layer i; 0 = the embeddings):

- top-level ``eagle_aux_hidden_state_layer_ids`` (speculators / vLLM): vLLM
  captures the stream before running layer i, so id i is HF index i;
- ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SpecForge / SGLang):
  SGLang captures the output of layer i (it adds one to each id), so id i is
  HF index i + 1;
- neither: the reference's fixed choice, HF indices (2, L // 2, L - 3) for a
  target of L layers.
"""

from __future__ import annotations

import re

from specdec.request.errors import InvalidArgument

REFERENCE, SPECULATORS = "reference", "speculators"
LAYER_PREFIXES = ("midlayer.", "layers.0.")
# Fields that mark a head config as EAGLE-3 rather than EAGLE-1/2.
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3Speculator", "Eagle3LlamaForCausalLM")


def is_eagle3_config(config: dict) -> bool:
    return (config.get("speculators_model_type") == "eagle3" or "draft_vocab_size" in config
            or any(a in EAGLE3_ARCHITECTURES for a in config.get("architectures") or ()))


def is_eagle3_keys(keys) -> bool:
    """Tensor names only an EAGLE-3 head has (the hidden-state norm, the vocabulary maps)."""
    return any(k in ("d2t", "t2d") or k.endswith("hidden_norm.weight") for k in keys)


def layout_of(config: dict) -> str:
    return SPECULATORS if "transformer_layer_config" in config or "speculators_model_type" in config else REFERENCE


def llama_fields(config: dict) -> dict:
    """The LlamaConfig fields of the head's decoder layer, plus the EAGLE-3 fields
    (``draft_vocab_size``, ``target_hidden_size``, ``norm_before_residual``)."""
    if layout_of(config) == SPECULATORS:
        fields = dict(config.get("transformer_layer_config") or {})
        if not fields:
            raise InvalidArgument("speculators EAGLE-3 config has no transformer_layer_config")
        norm_before_residual = bool(config.get("norm_before_residual", True))
    else:
        fields = {k: v for k, v in config.items() if k != "eagle_config"}
        norm_before_residual = bool(config.get("norm_before_residual", False))
    fields.pop("architectures", None)
    for name in ("hidden_size", "vocab_size", "num_attention_heads"):
        if name not in fields:
            raise InvalidArgument(f"EAGLE-3 head config has no {name}")
    fields["draft_vocab_size"] = int(config.get("draft_vocab_size") or fields["vocab_size"])
    fields["target_hidden_size"] = int(config.get("target_hidden_size") or fields.get("target_hidden_size")
                                       or fields["hidden_size"])
    fields["norm_before_residual"] = norm_before_residual
    return fields


def feature_layers(config: dict, target_layers: int | None) -> tuple[int, ...]:
    """The HF hidden-state indices the head reads (see the module doc for each convention)."""
    top = config.get("eagle_aux_hidden_state_layer_ids")
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if top:
        layers = tuple(int(i) for i in top)
    elif nested:
        layers = tuple(int(i) + 1 for i in nested)
    elif target_layers is None:
        raise InvalidArgument("EAGLE-3 head config names no feature layers and the target's depth is unknown")
    else:
        layers = default_feature_layers(target_layers)
    if len(layers) != 3:
        raise InvalidArgument(f"an EAGLE-3 head reads 3 target layers, its config names {len(layers)}")
    if target_layers is not None and not all(0 <= i < target_layers for i in layers):
        raise InvalidArgument(f"EAGLE-3 feature layers {list(layers)} (HF hidden-state indices) outside the "
                              f"target's 0..{target_layers - 1}")
    return layers


def default_feature_layers(target_layers: int) -> tuple[int, int, int]:
    """The reference's low, middle and high layers (2, L // 2, L - 3) for a target
    of ``target_layers`` layers, clamped to the un-normed layer inputs 0..L-1
    (index L is after the final norm) and sorted, so a shallow target still gets three."""
    picked = (min(max(i, 0), target_layers - 1) for i in (2, target_layers // 2, target_layers - 3))
    return tuple(sorted(picked))


def reference_layer_ids(layers) -> list[int]:
    """HF indices written the way the reference layout's ``eagle_config`` names them (one less)."""
    return [int(i) - 1 for i in layers]


def canonical_keys(state: dict) -> dict:
    """Tensor names in the reference spelling (``layers.0.`` -> ``midlayer.``); a
    checkpoint that prefixes everything with ``model.`` is read too."""
    out = {}
    for key, value in state.items():
        key = re.sub(r"^model\.", "", key)
        if key.startswith("layers.0."):
            key = "midlayer." + key[len("layers.0."):]
        out[key] = value
    return out


def check_state(state: dict, expected: dict, optional: tuple[str, ...], directory) -> None:
    """One error naming every missing, unexpected or mis-shaped tensor.
    ``expected``: name -> shape; names in ``optional`` may be absent."""
    missing = sorted(k for k in expected if k not in state and k not in optional)
    unexpected = sorted(k for k in state if k not in expected)
    shapes = sorted(f"{k} {tuple(state[k].shape)} (config implies {tuple(expected[k])})"
                    for k in state if k in expected and tuple(state[k].shape) != tuple(expected[k]))
    parts = [f"{label}: {', '.join(names)}" for label, names in
             (("missing", missing), ("unexpected", unexpected), ("mis-shaped", shapes)) if names]
    if parts:
        raise InvalidArgument(f"{directory} is not a valid EAGLE-3 head ({'; '.join(parts)})")
