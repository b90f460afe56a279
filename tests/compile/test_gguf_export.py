"""The GGUF exporter: names, shapes, values and metadata read back by the gguf
package's own reader, the rotary reordering proven on rotated dot products,
and refusals for what llama.cpp's llama architecture cannot hold."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from specdec.model.gguf_export import LlamaShape, UnsupportedExport, export_llama, interleave_rotary, read_vocab


def _field(reader, key):
    field = reader.fields[key]
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types[0] == gguf.GGUFValueType.STRING else value.tolist()[0]


def _array(reader, name) -> np.ndarray:
    t = next(t for t in reader.tensors if t.name == name)
    return np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)])


@pytest.fixture(scope="module")
def exported(tiny_family, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_family["target"], dtype=torch.float32)
    path = export_llama(tiny_family["target"], tmp_path_factory.mktemp("gguf") / "target.gguf")
    return model, gguf.GGUFReader(str(path))


def test_tensors_round_trip(exported):
    model, reader = exported
    cfg, state = model.config, model.state_dict()
    assert len(reader.tensors) == 3 + 9 * cfg.num_hidden_layers
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)
    assert np.array_equal(_array(reader, "token_embd.weight"), state["model.embed_tokens.weight"].numpy())
    assert np.array_equal(_array(reader, "output.weight"), state["lm_head.weight"].numpy())
    assert np.array_equal(_array(reader, "output_norm.weight"), state["model.norm.weight"].numpy())
    for i in range(cfg.num_hidden_layers):
        hf = f"model.layers.{i}."
        assert np.array_equal(_array(reader, f"blk.{i}.attn_v.weight"), state[hf + "self_attn.v_proj.weight"].numpy())
        assert np.array_equal(_array(reader, f"blk.{i}.ffn_down.weight"), state[hf + "mlp.down_proj.weight"].numpy())
        assert np.array_equal(_array(reader, f"blk.{i}.ffn_norm.weight"),
                              state[hf + "post_attention_layernorm.weight"].numpy())
        q = _array(reader, f"blk.{i}.attn_q.weight")
        assert q.shape == tuple(state[hf + "self_attn.q_proj.weight"].shape)
        assert np.array_equal(q, interleave_rotary(state[hf + "self_attn.q_proj.weight"].numpy(),
                                                   cfg.num_attention_heads))
        assert not np.array_equal(q, state[hf + "self_attn.q_proj.weight"].numpy())


def test_metadata_round_trip(exported, tiny_family):
    model, reader = exported
    cfg = model.config
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "llama.block_count") == cfg.num_hidden_layers
    assert _field(reader, "llama.embedding_length") == cfg.hidden_size
    assert _field(reader, "llama.attention.head_count") == cfg.num_attention_heads
    assert _field(reader, "llama.attention.head_count_kv") == cfg.num_key_value_heads
    assert _field(reader, "llama.feed_forward_length") == cfg.intermediate_size
    assert _field(reader, "general.file_type") == 0
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    vocab = read_vocab(tiny_family["target"], cfg.vocab_size)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == cfg.vocab_size
    assert [bytes(tokens.parts[i]).decode() for i in tokens.data[:50]] == vocab.tokens[:50]


def _rope_half(x, pos, base=10000.0):
    """HF Llama rotary: rotate the two halves of x [..., d]."""
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2) / d)
    ang = np.concatenate([pos * inv, pos * inv])
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * np.cos(ang) + np.concatenate([-x2, x1], axis=-1) * np.sin(ang)


def _rope_pairs(x, pos, base=10000.0):
    """llama.cpp's llama rotary: rotate adjacent pairs (x[2j], x[2j+1])."""
    d = x.shape[-1]
    ang = pos * base ** (-np.arange(0, d, 2) / d)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)
    return out


def test_interleaved_rows_give_the_same_rotated_scores():
    rng = np.random.default_rng(0)
    heads, d, width = 3, 8, 12
    wq, wk = rng.standard_normal((heads * d, width)), rng.standard_normal((heads * d, width))
    x, y = rng.standard_normal(width), rng.standard_normal(width)
    q_hf, k_hf = (wq @ x).reshape(heads, d), (wk @ y).reshape(heads, d)
    q_cpp = (interleave_rotary(wq, heads) @ x).reshape(heads, d)
    k_cpp = (interleave_rotary(wk, heads) @ y).reshape(heads, d)
    want = (_rope_half(q_hf, 7) * _rope_half(k_hf, 3)).sum(-1)
    got = (_rope_pairs(q_cpp, 7) * _rope_pairs(k_cpp, 3)).sum(-1)
    assert np.allclose(got, want, atol=1e-10)
    # without the reordering, llama.cpp's rotary would score differently
    wrong = (_rope_pairs(q_hf, 7) * _rope_pairs(k_hf, 3)).sum(-1)
    assert not np.allclose(wrong, want, atol=1e-3)


def test_refuses_what_llama_cpp_llama_cannot_hold():
    from transformers import LlamaConfig, Qwen2Config

    with pytest.raises(UnsupportedExport, match="only Llama"):
        LlamaShape.of(Qwen2Config(hidden_size=32, num_attention_heads=4))
    with pytest.raises(UnsupportedExport, match="bias"):
        LlamaShape.of(LlamaConfig(hidden_size=32, num_attention_heads=4, attention_bias=True))
    shape = LlamaShape.of(LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2))
    assert (shape.heads, shape.kv_heads, shape.head_dim) == (4, 2, 8)
