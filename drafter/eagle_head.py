"""The EAGLE-1/2 feature-level draft head, in the released checkpoint layout.

Layout (DESIGN.md §4), so released heads load unchanged:
  config.json  LlamaConfig with num_hidden_layers 1 (``bias`` false drops fc.bias)
  fc.weight [H, 2H] (+ fc.bias [H])
  layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.mlp.{gate,up,down}_proj.weight,
  layers.0.post_attention_layernorm.weight            (no input_layernorm)
The token embedding and lm_head are the target's, read from the target's
directory (only those two tensors; the drafter never loads the whole target).
Input at position t: fc(cat(embed(x_{t+1}), f_t)), where f_t is the target's
final-norm hidden state at t; the head's output approximates f_{t+1}.
Reference: Li et al., EAGLE (arXiv:2401.15077) and EAGLE-2 (arXiv:2406.16858).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specdec import attention, kv
from specdec.errors import InvalidArgument

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# Some released heads also carry a copy of the target's embedding: allowed, unused.
OPTIONAL_KEYS = ("embed_tokens.weight",)


def head_config(config_dict: dict):
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{k: v for k, v in config_dict.items() if k not in ("architectures",)})
    cfg.num_hidden_layers = 1
    cfg._attn_implementation = attention.IMPLEMENTATION
    return cfg


class EagleHead(nn.Module):
    """fc + one Llama decoder layer without its input norm."""

    def __init__(self, config, bias: bool = True):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=bias)
        layer = LlamaDecoderLayer(config, layer_idx=0)
        del layer.input_layernorm
        layer.input_layernorm = nn.Identity()
        self.layers = nn.ModuleList([layer])
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, token_embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """token_embeds, features: [B, n, H]; positions: [B, n]; mask: additive
        [B, 1, n, past + n] or None (causal). Returns hidden [B, n, H]."""
        h = self.fc(torch.cat([token_embeds, features.to(token_embeds.dtype)], dim=-1))
        past = kv.seq_len(cache) if cache is not None else 0
        if mask is None and past > 0 and h.shape[1] > 1:
            # SDPA's implicit causal mask is top-left aligned: wrong over a cache.
            mask = kv.causal_mask(h.shape[1], past, h.dtype)
        pe = self.rotary(h, positions)
        return self.layers[0](h, attention_mask=mask, position_ids=positions, past_key_values=cache,
                              use_cache=cache is not None, position_embeddings=pe)

    def expected_keys(self) -> set[str]:
        return set(self.state_dict().keys())


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        path = directory / name
        if path.is_file():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(path)
            return torch.load(path, map_location="cpu", weights_only=True)
    raise InvalidArgument(f"EAGLE head directory {directory} has none of {', '.join(WEIGHT_FILES)}")


def load_head(directory: str | Path, dtype=torch.float32) -> EagleHead:
    """Load a head saved in the EAGLE layout; names any missing/unexpected key."""
    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise InvalidArgument(f"EAGLE head directory {directory} has no config.json")
    config_dict = json.loads(cfg_path.read_text())
    head = EagleHead(head_config(config_dict), bias=bool(config_dict.get("bias", True)))
    state = {k: v for k, v in _read_weights(directory).items() if k not in OPTIONAL_KEYS}
    expected = head.expected_keys()
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys: {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {', '.join(unexpected)}")
        raise InvalidArgument(f"{directory} is not an EAGLE head checkpoint ({'; '.join(parts)})")
    for key, expected_tensor in head.state_dict().items():
        if state[key].shape != expected_tensor.shape:
            raise InvalidArgument(f"{directory}: {key} has shape {tuple(state[key].shape)}, "
                                  f"config implies {tuple(expected_tensor.shape)}")
    head.load_state_dict(state)
    return head.to(dtype).eval()


def save_head(head: EagleHead, directory: str | Path, dtype=torch.float16) -> None:
    """Write config.json + model.safetensors in the EAGLE layout."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = head.config.to_dict()
    config.update(num_hidden_layers=1, bias=head.fc.bias is not None, architectures=["LlamaForCausalLM"])
    config.pop("_attn_implementation", None)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file({k: v.detach().to(dtype).contiguous() for k, v in head.state_dict().items()},
              directory / "model.safetensors")


def load_target_embeddings(target_dir: str | Path, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Read only the target's input embedding [V, H] and lm_head [V, H] weights
    (tied models reuse the embedding) from its safetensors files."""
    from safetensors import safe_open

    target_dir = Path(target_dir)
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {k: target_dir / f for k, f in weight_map.items()}
    elif (target_dir / "model.safetensors").is_file():
        with safe_open(target_dir / "model.safetensors", "pt") as f:
            files = {k: target_dir / "model.safetensors" for k in f.keys()}
    else:
        raise InvalidArgument(f"target directory {target_dir} has no safetensors weights")

    def fetch(suffix: str) -> torch.Tensor | None:
        key = next((k for k in files if k.endswith(suffix)), None)
        if key is None:
            return None
        with safe_open(files[key], "pt") as f:
            return f.get_tensor(key).to(dtype)

    embed = fetch("embed_tokens.weight")
    if embed is None:
        raise InvalidArgument(f"target directory {target_dir} has no embed_tokens weight")
    lm_head = fetch("lm_head.weight")
    return embed, (embed if lm_head is None else lm_head)
