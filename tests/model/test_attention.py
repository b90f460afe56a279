"""specdec.model.attention: transformers' SDPA numbers for grouped-query models,
without copying the KV heads (repeat_kv) for tree-masked forwards on CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.integrations import sdpa_attention

from specdec.model import attention, kv, masks
from specdec.model.kv import new_cache
from specdec.model.loading import ModelSpec, load_causal_lm


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    """A tiny Llama with 4 query heads over 2 KV heads, loaded as specdec loads targets."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.15,
                         tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("gqa")
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return load_causal_lm(ModelSpec(str(path)))


def _prefill_then_tree(model) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 97, (1, 23), generator=gen)
    tree = torch.randint(0, 97, (1, 9), generator=gen)
    parents = [-1, 0, 0, 1, 1, 2, 3, 5, 5]
    ancestor = torch.zeros(9, 9, dtype=torch.bool)
    for i, p in enumerate(parents):
        ancestor[i, i] = True
        if p >= 0:
            ancestor[i] |= ancestor[p]
    depths = ancestor.sum(-1) - 1
    with torch.inference_mode():
        cache = new_cache(model.config, 64)
        first = model(prompt, use_cache=True, **kv.with_cache(model, cache)).logits
        second = model(tree, **kv.with_cache(model, cache), attention_mask=masks.tree_attention_mask(ancestor, 23),
                       position_ids=(23 + depths)[None], use_cache=True).logits
    return first, second


def test_loaded_models_use_it_and_never_repeat_kv_heads(gqa_model, monkeypatch):
    assert gqa_model.config._attn_implementation == attention.IMPLEMENTATION

    def no_copy(*args):
        raise AssertionError("repeat_kv called")

    monkeypatch.setattr(sdpa_attention, "repeat_kv", no_copy)
    _prefill_then_tree(gqa_model)              # a causal prefill and a tree-masked forward


def test_same_numbers_as_transformers_sdpa(gqa_model):
    ours = _prefill_then_tree(gqa_model)
    try:
        AttentionInterface.register(attention.IMPLEMENTATION, sdpa_attention.sdpa_attention_forward)
        theirs = _prefill_then_tree(gqa_model)
    finally:
        AttentionInterface.register(attention.IMPLEMENTATION, attention.sdpa_forward)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_user_facing_choices():
    from transformers import Gemma2ForCausalLM

    assert attention.choose_implementation(LlamaForCausalLM, "auto") == attention.IMPLEMENTATION
    assert attention.choose_implementation(LlamaForCausalLM, "sdpa") == attention.IMPLEMENTATION
    assert attention.choose_implementation(LlamaForCausalLM, "eager") == "eager"
    # soft-capped attention has no SDPA path: auto falls back to eager, an explicit sdpa is refused
    assert attention.choose_implementation(Gemma2ForCausalLM, "auto") == "eager"
    with pytest.raises(ValueError, match="Gemma2ForCausalLM has no SDPA"):
        attention.choose_implementation(Gemma2ForCausalLM, "sdpa")
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'"):
        attention.choose_implementation(LlamaForCausalLM, "flash")
