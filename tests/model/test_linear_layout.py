"""Linear weights laid out input-major on CPU (``specdec.model.loading.input_major_linears``):
the same values and the same logits, tied weights still one tensor, the layout
off when asked, and compiled packages keyed on it."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.model.loading import LINEAR_LAYOUT_ENV, ModelSpec, input_major_linears, linear_layout, load_causal_lm


def _tied_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def test_same_values_same_logits_and_tied_weights_stay_one():
    model = _tied_llama()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        want = model(ids).logits
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert input_major_linears(model) == len(linears)          # lm_head is the embedding: counted once
    for linear in linears:
        out_features, in_features = linear.weight.shape
        assert linear.weight.stride() == (1, out_features) and not linear.weight.is_contiguous()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
    assert input_major_linears(model) == 0                      # laid out once


def test_loading_on_cpu_lays_out_float32_unless_turned_off(tiny_family, monkeypatch):
    laid = load_causal_lm(ModelSpec(str(tiny_family["target"])))
    assert not laid.model.layers[0].mlp.down_proj.weight.is_contiguous()
    half = load_causal_lm(ModelSpec(str(tiny_family["target"]), dtype="bfloat16"))
    assert half.model.layers[0].mlp.down_proj.weight.is_contiguous()      # oneDNN's layout kept in half precision
    monkeypatch.setenv(LINEAR_LAYOUT_ENV, "off")
    plain = load_causal_lm(ModelSpec(str(tiny_family["target"])))
    assert plain.model.layers[0].mlp.down_proj.weight.is_contiguous()
    monkeypatch.setenv(LINEAR_LAYOUT_ENV, "sideways")
    with pytest.raises(ValueError, match=f"{LINEAR_LAYOUT_ENV} must be one of auto, off"):
        linear_layout()


def test_compiled_packages_key_on_the_layout():
    """A package traced over one layout must never be loaded over the other."""
    from specdec.compile.aot import _fingerprint

    model = _tied_llama()
    plain = _fingerprint(model)
    input_major_linears(model)
    assert _fingerprint(model) != plain
