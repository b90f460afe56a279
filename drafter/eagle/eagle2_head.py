"""The EAGLE-1/2 feature-level draft head, in the released checkpoint layout.

Layout (DESIGN.md §4), so released heads load unchanged:
  config.json  LlamaConfig with num_hidden_layers 1 (``bias`` false drops fc.bias)
  fc.weight [H, 2H] (+ fc.bias [H])
  layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.mlp.{gate,up,down}_proj.weight,
  layers.0.post_attention_layernorm.weight            (no input_layernorm)
The token embedding and lm_head are the target's, read from the target's
directory (only those two tensors; the drafter never loads the whole target)
for any family, tied or not (``load_target_head``); the head's logits get the
target's own final-logit processing.
Input at position t: fc(cat(embed(x_{t+1}), f_t)), where f_t is the target's
final-norm hidden state at t; the head's output approximates f_{t+1}.
Reference: Li et al., EAGLE (arXiv:2401.15077) and EAGLE-2 (arXiv:2406.16858).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdec.model import attention, kv, masks
from specdec.model.causal_lm import final_logit_transform
from specdec.model.loading import causal_lm_class
from specdec.request.errors import InvalidArgument

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# Some released heads also carry a copy of the target's embedding: allowed, unused.
OPTIONAL_KEYS = ("embed_tokens.weight",)


def head_config(config_dict: dict):
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{k: v for k, v in config_dict.items() if k not in ("architectures",)})
    cfg.num_hidden_layers = 1
    cfg._attn_implementation = attention.IMPLEMENTATION
    return cfg


def head_config_for(target_config) -> dict:
    """A head config dict (LlamaConfig fields) for a target of any family: its
    width, heads and vocabulary, read through transformers' attribute names."""
    text = target_config.get_text_config(decoder=True)
    hidden, heads = int(text.hidden_size), int(text.num_attention_heads)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        kv_heads = heads
    return {"vocab_size": int(text.vocab_size), "hidden_size": hidden, "num_attention_heads": heads,
            "num_key_value_heads": int(kv_heads), "head_dim": hidden // heads,
            "intermediate_size": int(getattr(text, "intermediate_size", None) or 4 * hidden),
            "max_position_embeddings": int(getattr(text, "max_position_embeddings", None) or 4096),
            "rms_norm_eps": float(getattr(text, "rms_norm_eps", None) or 1e-6), "tie_word_embeddings": False}


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
            mask = masks.causal_mask(h.shape[1], past, h.dtype).to(h.device)
        pe = self.rotary(h, positions)
        return self.layers[0](h, attention_mask=mask, position_ids=positions, use_cache=cache is not None,
                              position_embeddings=pe, **kv.with_cache(self.layers[0], cache))

    def expected_keys(self) -> set[str]:
        return set(self.state_dict().keys())


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
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
    state = {k: v for k, v in read_weights(directory).items() if k not in OPTIONAL_KEYS}
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


@dataclass(frozen=True)
class TargetHead:
    """What an EAGLE head borrows from its target: the input embedding table
    [V, H], the output head's weight [V, H] and the target's own processing of
    the head's logits (``specdec.model.causal_lm.final_logit_transform``)."""

    embed: torch.Tensor
    lm_head: torch.Tensor
    transform: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def of_model(cls, model) -> TargetHead:
        """From a loaded ``*ForCausalLM`` (the public API: input and output embeddings)."""
        embed = model.get_input_embeddings().weight
        out = model.get_output_embeddings()
        return cls(embed.detach(), (embed if out is None else out.weight).detach(),
                   final_logit_transform(model.config))

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ``tokens`` (the table itself, as EAGLE heads are trained on)."""
        return torch.nn.functional.embedding(tokens, self.embed)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of hidden states [..., H], processed as the target processes its own."""
        return self.transform(torch.nn.functional.linear(hidden.to(self.lm_head.dtype), self.lm_head)).float()

    def to(self, device) -> TargetHead:
        return TargetHead(self.embed.to(device), self.lm_head.to(device), self.transform)


def _checkpoint_files(target_dir: Path) -> dict[str, Path]:
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        return {k: target_dir / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    if (target_dir / "model.safetensors").is_file():
        from safetensors import safe_open

        with safe_open(target_dir / "model.safetensors", "pt") as f:
            return {k: target_dir / "model.safetensors" for k in f.keys()}
    raise InvalidArgument(f"target directory {target_dir} has no safetensors weights")


def load_target_head(target_dir: str | Path, dtype=torch.float32) -> TargetHead:
    """Read only the target's input embedding and output head from its
    safetensors files, for any causal LM family: the model is built on the
    meta device (no memory) to ask it, through ``get_input_embeddings()`` and
    ``get_output_embeddings()``, which parameters those are; a tied output
    head reuses the embedding."""
    from safetensors import safe_open
    from transformers import AutoConfig

    target_dir = Path(target_dir)
    config = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    with torch.device("meta"):
        model = causal_lm_class(target_dir)(config)
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)            # a tied head keeps the embedding's name
    embed_param = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is None or out.weight is embed_param
    files = _checkpoint_files(target_dir)

    def fetch(param: torch.nn.Parameter) -> torch.Tensor | None:
        name = names[id(param)]
        # checkpoints may name a parameter with or without the base model's prefix
        key = name if name in files else next((k for k in files if k.endswith(name) or name.endswith(k)), None)
        if key is None:
            return None
        with safe_open(files[key], "pt") as f:
            return f.get_tensor(key).to(dtype)

    embed = fetch(embed_param)
    if embed is None:
        raise InvalidArgument(f"target directory {target_dir} has no weight for {names[id(embed_param)]}")
    lm_head = None if tied else fetch(out.weight)
    return TargetHead(embed, embed if lm_head is None else lm_head, final_logit_transform(config))
