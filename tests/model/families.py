"""Tiny random-weight models of transformers' own causal-LM architectures, one
per attention variant specdec serves, built from transformers' config classes
(seeded; nothing is downloaded).

``FAMILIES`` is the test matrix: each entry names the family, the variant it
stands for and how to build its config. ``docs/models.md`` is generated from
it (``tests/model/test_models_table.py`` keeps the two in sync).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

H, LAYERS, HEADS = 32, 2, 4
WIDE = 1 << 12           # a window far larger than any test sequence
NARROW = 6               # a window shorter than prompt + new tokens


def _common(vocab: int) -> dict:
    return dict(vocab_size=vocab, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, max_position_embeddings=256, initializer_range=0.2,
                bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _llama(v):
    from transformers import LlamaConfig
    return LlamaConfig(**_common(v), num_key_value_heads=2, tie_word_embeddings=False)


def _qwen2_sliding(v):
    from transformers import Qwen2Config
    # layer 0 full, layer 1 sliding (max_window_layers counts the full layers)
    return Qwen2Config(**_common(v), num_key_value_heads=2, use_sliding_window=True, sliding_window=NARROW,
                       max_window_layers=1, tie_word_embeddings=True)


def _qwen3(v):
    from transformers import Qwen3Config
    return Qwen3Config(**_common(v), num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)


def _qwen3_sliding(v):
    from transformers import Qwen3Config
    # the other order from qwen2-sliding: layer 0 sliding, layer 1 full
    return Qwen3Config(**_common(v), num_key_value_heads=2, head_dim=8, use_sliding_window=True, sliding_window=NARROW,
                       layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)


def _mistral(window):
    def build(v):
        from transformers import MistralConfig
        return MistralConfig(**_common(v), num_key_value_heads=2, sliding_window=window, tie_word_embeddings=False)
    return build


def _mixtral(v):
    from transformers import MixtralConfig
    return MixtralConfig(**_common(v), num_key_value_heads=2, sliding_window=NARROW, num_local_experts=4,
                         num_experts_per_tok=2, tie_word_embeddings=False)


def _qwen3_moe(v):
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(**_common(v), num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=H, decoder_sparse_step=1, tie_word_embeddings=False)


def _phi3(v):
    from transformers import Phi3Config
    return Phi3Config(**_common(v), num_key_value_heads=2, sliding_window=NARROW, partial_rotary_factor=0.5,
                      tie_word_embeddings=False)


def _gemma2(v):
    from transformers import Gemma2Config
    return Gemma2Config(**_common(v), num_key_value_heads=2, head_dim=8, sliding_window=NARROW,
                        attn_logit_softcapping=20.0, final_logit_softcapping=5.0, query_pre_attn_scalar=8)


def _gemma3(v):
    from transformers import Gemma3TextConfig
    return Gemma3TextConfig(**_common(v), num_key_value_heads=2, head_dim=8, sliding_window=NARROW,
                            layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=5.0,
                            query_pre_attn_scalar=8)


def _gpt2(v):
    from transformers import GPT2Config
    return GPT2Config(vocab_size=v, n_embd=H, n_layer=LAYERS, n_head=HEADS, n_positions=256,
                      initializer_range=0.2, bos_token_id=0, eos_token_id=0)


def _opt(v):
    from transformers import OPTConfig
    return OPTConfig(vocab_size=v, hidden_size=H, ffn_dim=2 * H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                     word_embed_proj_dim=H, max_position_embeddings=256, init_std=0.2,
                     bos_token_id=0, eos_token_id=0, pad_token_id=1)


def _gpt_neox(v):
    from transformers import GPTNeoXConfig
    return GPTNeoXConfig(**_common(v), rotary_pct=0.5, tie_word_embeddings=False)


def _stablelm(v):
    from transformers import StableLmConfig
    return StableLmConfig(**_common(v), num_key_value_heads=2, partial_rotary_factor=0.25)


def _falcon(v):
    from transformers import FalconConfig
    return FalconConfig(vocab_size=v, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        multi_query=True, new_decoder_architecture=False, alibi=False, initializer_range=0.2,
                        max_position_embeddings=256, bos_token_id=0, eos_token_id=0)


def _cohere(v):
    from transformers import CohereConfig
    return CohereConfig(**_common(v), num_key_value_heads=2, logit_scale=0.5)


def _granite(v):
    from transformers import GraniteConfig
    return GraniteConfig(**_common(v), num_key_value_heads=2, logits_scaling=2.0, tie_word_embeddings=False)


def _olmo(v):
    from transformers import OlmoConfig
    return OlmoConfig(**_common(v), num_key_value_heads=2, tie_word_embeddings=False)


def _falcon_alibi(v):
    from transformers import FalconConfig
    return FalconConfig(vocab_size=v, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        multi_query=True, new_decoder_architecture=False, alibi=True, initializer_range=0.2,
                        max_position_embeddings=256, bos_token_id=0, eos_token_id=0)


def _bloom(v):
    from transformers import BloomConfig
    return BloomConfig(vocab_size=v, hidden_size=H, n_layer=LAYERS, n_head=HEADS, initializer_range=0.2,
                       bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _mpt(v):
    from transformers import MptConfig
    # 6 heads: not a power of two, so MPT's interleaved slopes are covered
    return MptConfig(vocab_size=v, d_model=6 * 8, n_heads=6, n_layers=LAYERS, expansion_ratio=2, max_seq_len=256,
                     initializer_range=0.2, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _mamba(v):
    from transformers import MambaConfig
    return MambaConfig(vocab_size=v, hidden_size=H, state_size=4, num_hidden_layers=LAYERS, expand=2,
                       initializer_range=0.2, bos_token_id=0, eos_token_id=0, pad_token_id=0)


@dataclass(frozen=True)
class Family:
    name: str
    variant: str                          # what this family stands for in the matrix
    config: Callable[[int], object]       # vocab size -> transformers config
    window: int | None = None             # sliding window of its sliding layers


FAMILIES = (
    Family("llama", "grouped-query attention, full attention", _llama),
    Family("qwen2-sliding", "hybrid full/sliding layers (window shorter than the sequence), tied embeddings",
           _qwen2_sliding, NARROW),
    Family("qwen3", "q/k norms, explicit head_dim, tied embeddings", _qwen3),
    Family("qwen3-sliding", "hybrid sliding/full layers (window shorter than the sequence)", _qwen3_sliding, NARROW),
    Family("mistral-wide", "sliding window larger than the sequence", _mistral(WIDE), WIDE),
    Family("mistral-narrow", "sliding window shorter than the sequence", _mistral(NARROW), NARROW),
    Family("mixtral", "mixture of experts, sliding window", _mixtral, NARROW),
    Family("qwen3-moe", "mixture of experts", _qwen3_moe),
    Family("phi3", "partial rotary, sliding window", _phi3, NARROW),
    Family("gemma2", "attention and final-logit soft-capping, alternating sliding/full layers",
           _gemma2, NARROW),
    Family("gemma3", "hybrid sliding/full layers, final-logit soft-capping, scaled embeddings", _gemma3, NARROW),
    Family("gpt2", "learned absolute positions, tied embeddings", _gpt2),
    Family("opt", "learned absolute positions (offset)", _opt),
    Family("gpt-neox", "partial rotary, parallel residual", _gpt_neox),
    Family("stablelm", "partial rotary", _stablelm),
    Family("falcon", "multi-query attention", _falcon),
    Family("cohere", "final logit_scale", _cohere),
    Family("granite", "final logits_scaling", _granite),
    Family("olmo", "non-parametric layer norm", _olmo),
    Family("falcon-alibi", "ALiBi (Falcon-RW), multi-query attention", _falcon_alibi),
    Family("bloom", "ALiBi, embedding layer norm, tied embeddings", _bloom),
    Family("mpt", "ALiBi (slopes for a head count that is not a power of two)", _mpt),
)

REFUSED = (
    Family("mamba", "state-space layers", _mamba),
)

BY_NAME = {f.name: f for f in FAMILIES + REFUSED}


def build_model(family: Family, vocab: int, seed: int = 0):
    """The family's ``*ForCausalLM`` with seeded random weights, eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(family.config(vocab)).eval()


def save_model(family: Family, root: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Save the family's tiny model with the test tokenizer beside it; returns its directory."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    path = root / f"{family.name}-{seed}"
    if not (path / "config.json").is_file():
        build_model(family, len(tok), seed).save_pretrained(path)
        tok.save_pretrained(path)
    return path


# -- docs/models.md is generated from the matrix ----------------------------------------------------
DOCS = Path(__file__).resolve().parents[2] / "docs" / "models.md"
BEGIN, END = "<!-- families:begin (generated: python tests/model/families.py) -->", "<!-- families:end -->"


def table() -> str:
    """The markdown table of the matrix: served families, then refused ones."""
    from transformers import AutoModelForCausalLM

    from specdec.model.attention import IMPLEMENTATION, choose_implementation

    rows = ["| family (test id) | transformers class | what it covers | attention (auto) |",
            "|---|---|---|---|"]
    for family in FAMILIES:
        cls = AutoModelForCausalLM._model_mapping[type(family.config(64))]
        impl = {IMPLEMENTATION: "specdec SDPA", "sdpa": "transformers SDPA"}.get(choose_implementation(cls, "auto"),
                                                                                  "eager")
        rows.append(f"| {family.name} | `{cls.__name__}` | {family.variant} | {impl} |")
    refused = ", ".join(f"`{AutoModelForCausalLM._model_mapping[type(f.config(64))].__name__}` ({f.variant})"
                        for f in REFUSED)
    return "\n".join(rows) + f"\n\nRefused at load, with a one-line reason: {refused}.\n"


def render(text: str) -> str:
    """``text`` (docs/models.md) with the table between the markers regenerated."""
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{table()}{END}{tail}"


if __name__ == "__main__":
    DOCS.write_text(render(DOCS.read_text()))
    print(f"wrote {DOCS}")
