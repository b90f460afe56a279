"""EAGLE heads in the released checkpoint layout: load, draft, clear errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.request.errors import InvalidArgument
from specdec.request.params import TreeParams
from drafter.eagle.eagle2 import EagleDrafter
from drafter.eagle.eagle2_head import load_head

LAYOUT = {
    "fc.weight", "fc.bias",
    "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
    "layers.0.post_attention_layernorm.weight",
}


def test_saved_head_has_exactly_the_eagle_layout(tiny_family):
    keys = set(load_file(tiny_family["eagle"] / "model.safetensors"))
    assert keys == LAYOUT
    config = json.loads((tiny_family["eagle"] / "config.json").read_text())
    assert config["num_hidden_layers"] == 1


def test_head_loads_and_drafts(tiny_family):
    drafter = EagleDrafter(tiny_family["eagle"], tiny_family["target"])
    h = drafter.hidden_size
    drafter.prefill("s", [3, 4, 5, 6], torch.randn(3, h))
    tree = drafter.draft("s", TreeParams(total_tokens=8, depth=3, expand_k=2))
    assert tree.size == 8 and int(tree.tokens[0]) == 6
    drafter.commit("s", [int(tree.tokens[1]), 9], torch.randn(2, h))
    assert int(drafter.draft("s", TreeParams(total_tokens=4)).tokens[0]) == 9


def test_bias_free_head_and_extra_embedding_copy_load(tiny_family, tmp_path):
    state = load_file(tiny_family["eagle"] / "model.safetensors")
    del state["fc.bias"]
    state["embed_tokens.weight"] = torch.zeros(10, 4)          # some released heads carry it
    config = json.loads((tiny_family["eagle"] / "config.json").read_text()) | {"bias": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(state, tmp_path / "model.safetensors")
    head = load_head(tmp_path)
    assert head.fc.bias is None


def test_pytorch_bin_checkpoint_loads(tiny_family, tmp_path):
    state = load_file(tiny_family["eagle"] / "model.safetensors")
    (tmp_path / "config.json").write_text((tiny_family["eagle"] / "config.json").read_text())
    torch.save(state, tmp_path / "pytorch_model.bin")
    assert load_head(tmp_path).fc.weight.shape == state["fc.weight"].shape


@pytest.mark.parametrize("edit,needle", [
    (lambda s: s.pop("layers.0.mlp.up_proj.weight"), "missing keys: layers.0.mlp.up_proj.weight"),
    (lambda s: s.update({"layers.1.mlp.up_proj.weight": torch.zeros(1)}), "unexpected keys: layers.1.mlp.up_proj.weight"),
    (lambda s: s.update({"fc.weight": torch.zeros(3, 3)}), "fc.weight has shape (3, 3)"),
])
def test_bad_checkpoints_name_the_problem(tiny_family, tmp_path, edit, needle):
    state = load_file(tiny_family["eagle"] / "model.safetensors")
    edit(state)
    (tmp_path / "config.json").write_text((tiny_family["eagle"] / "config.json").read_text())
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(InvalidArgument, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_head(tmp_path)


def test_directory_without_weights(tmp_path, tiny_family):
    (tmp_path / "config.json").write_text((tiny_family["eagle"] / "config.json").read_text())
    with pytest.raises(InvalidArgument, match="has none of"):
        load_head(tmp_path)


def test_drafting_twice_without_commit_gives_the_same_tree(tiny_family):
    """A retried Draft (nothing committed in between) must not fail or change the tree."""
    drafter = EagleDrafter(tiny_family["eagle"], tiny_family["target"])
    drafter.prefill("s", [3, 4, 5, 6], torch.randn(3, drafter.hidden_size))
    cfg = TreeParams(total_tokens=8, depth=3, expand_k=2)
    first, again = drafter.draft("s", cfg), drafter.draft("s", cfg)
    assert first.tokens.tolist() == again.tokens.tolist() and first.parents.tolist() == again.parents.tolist()
    drafter.rollback("s", 3)
    assert int(drafter.draft("s", cfg).tokens[0]) == 5


def copy_head(src, dst):
    for name in ("config.json", "model.safetensors"):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def test_calibration_file_sets_the_greedy_value_temperature(tiny_family, tmp_path):
    """A greedy session ranks its tree with the head's fitted temperature, a
    sampled one with the plain draft log-probs; an explicit knob wins over both."""
    head_dir = copy_head(tiny_family["eagle"], tmp_path)
    assert EagleDrafter(head_dir, tiny_family["target"]).greedy_value_temperature == 1.0   # no file: as released
    (head_dir / "calibration.json").write_text(json.dumps({"greedy_value_temperature": 0.3}))
    drafter = EagleDrafter(head_dir, tiny_family["target"])
    assert drafter.greedy_value_temperature == 0.3
    feats = torch.randn(3, drafter.hidden_size, generator=torch.Generator().manual_seed(0))
    cfg = TreeParams(total_tokens=8, depth=3, expand_k=2)
    trees = {}
    for sid, greedy in (("greedy", True), ("sampled", False)):
        drafter.prefill(sid, [3, 4, 5, 6], feats, greedy=greedy)
        trees[sid] = drafter.draft(sid, cfg)
        for t in (0.3, 1.0):
            trees[sid, t] = drafter.draft(sid, TreeParams(total_tokens=8, depth=3, expand_k=2, value_temperature=t))
    assert torch.equal(trees["greedy"].values, trees["greedy", 0.3].values)
    assert torch.equal(trees["sampled"].values, trees["sampled", 1.0].values)
    assert torch.equal(trees["greedy", 1.0].values, trees["sampled", 1.0].values)
    assert not torch.equal(trees["greedy"].values, trees["sampled"].values)


@pytest.mark.parametrize("text", ['{"greedy_value_temperature": 0}', '{"t": 1}', "not json", "[1]"])
def test_bad_calibration_file_names_it(tiny_family, tmp_path, text):
    head_dir = copy_head(tiny_family["eagle"], tmp_path)
    (head_dir / "calibration.json").write_text(text)
    with pytest.raises(ValueError, match="calibration.json"):
        EagleDrafter(head_dir, tiny_family["target"])


def test_one_token_session_is_refused_up_front(tiny_family):
    drafter = EagleDrafter(tiny_family["eagle"], tiny_family["target"])
    with pytest.raises(InvalidArgument, match="at least 2 tokens"):
        drafter.prefill("s", [3], torch.zeros(0, drafter.hidden_size))
    assert len(drafter.sessions) == 0
