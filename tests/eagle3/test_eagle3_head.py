"""The EAGLE-3 head module: the reference's tensor names and shapes, its forward API."""

import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from eagle3_family import DRAFT_VOCAB, TARGET_LAYERS, random_head3, read_config
from specdec.model import kv
from drafter.eagle.eagle3_head import load_head3


def reference_shapes(hidden, heads, kv_heads, head_dim, inter, vocab, draft_vocab, target_hidden):
    """The state dict of the EAGLE authors' EAGLE-3 ``Model`` (cnets.py), written out by hand."""
    shapes = {
        "lm_head.weight": (draft_vocab, hidden),
        "fc.weight": (hidden, 3 * target_hidden),
        "norm.weight": (hidden,),
        "d2t": (draft_vocab,),
        "t2d": (vocab,),
        "midlayer.self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": (hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": (inter, hidden),
        "midlayer.mlp.up_proj.weight": (inter, hidden),
        "midlayer.mlp.down_proj.weight": (hidden, inter),
        "midlayer.hidden_norm.weight": (hidden,),
        "midlayer.input_layernorm.weight": (hidden,),
        "midlayer.post_attention_layernorm.weight": (hidden,),
    }
    return shapes


def test_saved_head_has_exactly_the_reference_keys_and_shapes(family3):
    state = load_file(family3["eagle3"] / "model.safetensors")
    target = AutoConfig.from_pretrained(family3["target"])
    h = target.hidden_size
    expected = reference_shapes(h, 2, 2, h // 2, target.intermediate_size, target.vocab_size, DRAFT_VOCAB, h)
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    config = read_config(family3["eagle3"])
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["num_hidden_layers"] == 1
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]


def test_saved_layers_round_trip_as_hf_indices(family3):
    # reference default (2, L//2, L-3); the saved eagle_config counts layer outputs (one less)
    assert read_config(family3["eagle3"])["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]
    assert load_head3(family3["eagle3"]).layers == (2, TARGET_LAYERS // 2, TARGET_LAYERS - 3)


def test_load_round_trips_every_tensor(family3):
    head = random_head3(family3["target"])
    loaded = load_head3(family3["eagle3"])
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_d2t_maps_draft_ids_and_t2d_marks_them(family3):
    head = load_head3(family3["eagle3"])
    draft = torch.arange(head.draft_vocab_size)
    target_ids = head.to_target_ids(draft)
    assert target_ids.unique().numel() == head.draft_vocab_size
    assert bool(head.t2d[target_ids].all()) and int(head.t2d.sum()) == head.draft_vocab_size
    assert not torch.equal(target_ids, draft)                 # offsets are non-trivial here


def test_forward_unrolls_from_projected_features(family3):
    head = load_head3(family3["eagle3"])
    h = head.config.hidden_size
    feats = torch.randn(1, 5, 3 * h)
    tokens = torch.tensor([[3, 4, 5, 6, 7]])
    positions = torch.arange(5)[None]
    head.set_embedding(torch.randn(head.t2d.numel(), h))
    out = head(head.embed_tokens(tokens), head.project(feats), positions)
    assert out.shape == (1, 5, h)
    assert head.draft_logits(out).shape == (1, 5, head.draft_vocab_size)
    # step 2 feeds the head's own output back in, shifted one position
    out2 = head(head.embed_tokens(tokens[:, 1:]), out[:, :-1], positions[:, 1:])
    assert out2.shape == (1, 4, h) and torch.isfinite(out2).all()
    # the causal forward equals a token-at-a-time forward over a cache
    cache = kv.new_cache(head.config)
    with torch.inference_mode():
        steps = [head(head.embed_tokens(tokens[:, i:i + 1]), head.project(feats[:, i:i + 1]),
                      positions[:, i:i + 1], None, cache) for i in range(5)]
    torch.testing.assert_close(torch.cat(steps, 1), out, rtol=1e-4, atol=1e-5)
