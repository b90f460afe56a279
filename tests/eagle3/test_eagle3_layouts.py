"""Released EAGLE-3 heads load unchanged: the reference and the speculators /
vLLM layouts, each format's layer counting, and one clear error for a bad head."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_family import TARGET_LAYERS, read_config
from specdec.cli.main import main
from specdec.request.errors import InvalidArgument
from specdec.request.params import TreeParams
from drafter.eagle import eagle3_layouts as layouts
from drafter.eagle.eagle3 import Eagle3Drafter
from drafter.eagle.eagle3_head import load_head3

CFG = TreeParams(total_tokens=10, depth=3, expand_k=3)


def as_speculators(src, dst, norm_before_residual=False, layer_ids=None) -> None:
    """``src`` (reference layout) rewritten the way the speculators library
    writes a head: Llama fields under transformer_layer_config, ``layers.0.*``
    tensor names, layer ids at top level counted as HF hidden-state indices."""
    config = read_config(src)
    layers = [i + 1 for i in config.pop("eagle_config")["eagle_aux_hidden_state_layer_ids"]]
    draft_vocab, target_hidden = config.pop("draft_vocab_size"), config.pop("target_hidden_size")
    config.pop("architectures")
    spec = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": config, "draft_vocab_size": draft_vocab,
            "target_hidden_size": target_hidden, "eagle_aux_hidden_state_layer_ids": layer_ids or layers,
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy"}}
    if norm_before_residual is not None:
        spec["norm_before_residual"] = norm_before_residual
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(spec))
    state = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(src / "model.safetensors").items()}
    save_file(state, dst / "model.safetensors")


def drafted(head_dir, target_dir, prompt_feats):
    drafter = Eagle3Drafter(head_dir, target_dir)
    drafter.prefill("s", [3, 4, 5, 6, 7], prompt_feats)
    return drafter.draft("s", CFG)


def test_speculators_layout_loads_and_drafts_like_the_reference(family3, tmp_path):
    as_speculators(family3["eagle3"], tmp_path / "spec")
    ref, spec = load_head3(family3["eagle3"]), load_head3(tmp_path / "spec")
    assert spec.layers == ref.layers
    for key, value in ref.state_dict().items():
        assert torch.equal(spec.state_dict()[key], value), key
    torch.manual_seed(0)
    feats = torch.randn(4, ref.fc.in_features)
    a, b = drafted(family3["eagle3"], family3["target"], feats), drafted(tmp_path / "spec", family3["target"], feats)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


def test_speculators_layout_normalises_before_the_residual_unless_told_otherwise(family3, tmp_path):
    as_speculators(family3["eagle3"], tmp_path / "spec", norm_before_residual=None)
    head = load_head3(tmp_path / "spec")
    assert head.midlayer.norm_before_residual          # vLLM's reading of a speculators config
    assert not load_head3(family3["eagle3"]).midlayer.norm_before_residual
    h = head.config.hidden_size
    head.set_embedding(torch.randn(head.t2d.numel(), h))
    feature = 5.0 * torch.randn(1, 3, h)
    emb, pos = head.embed_tokens(torch.tensor([[1, 2, 3]])), torch.arange(3)[None]
    normed = head(emb, feature, pos)
    head.midlayer.norm_before_residual = False
    assert not torch.allclose(normed, head(emb, feature, pos))


@pytest.mark.parametrize("config,want", [
    ({}, (2, TARGET_LAYERS // 2, TARGET_LAYERS - 3)),                              # the reference's fixed choice
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}}, (2, 3, 5)),  # SpecForge: layer outputs
    ({"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}, (1, 2, 4)),                  # vLLM: layer inputs
    ({"speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": [0, 3, 5]}, (0, 3, 5)),
])
def test_layer_ids_of_each_format_are_hf_hidden_state_indices(config, want):
    assert layouts.feature_layers(config, TARGET_LAYERS) == want


@pytest.mark.parametrize("config,needle", [
    ({"eagle_aux_hidden_state_layer_ids": [1, 2, TARGET_LAYERS]}, "outside"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, TARGET_LAYERS - 1]}}, "outside"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 2]}, "3 target layers"),
])
def test_bad_layer_ids_are_refused(config, needle):
    with pytest.raises(InvalidArgument, match=needle):
        layouts.feature_layers(config, TARGET_LAYERS)


def test_speculators_ids_reach_the_verifier_as_written(family3, tmp_path):
    as_speculators(family3["eagle3"], tmp_path / "spec", layer_ids=[0, 4, 5])
    assert Eagle3Drafter(tmp_path / "spec", family3["target"]).feature_layers == (0, 4, 5)


def broken_copy(src, dst, edit):
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    edit(state)
    save_file(state, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("edit,needles", [
    (lambda s: s.pop("midlayer.hidden_norm.weight"), ["missing: midlayer.hidden_norm.weight"]),
    (lambda s: s.update({"midlayer.extra.weight": torch.zeros(2)}), ["unexpected: midlayer.extra.weight"]),
    (lambda s: s.update({"fc.weight": torch.zeros(4, 4)}), ["mis-shaped: fc.weight (4, 4)"]),
    (lambda s: (s.pop("d2t"), s.update({"lm_head.weight": torch.zeros(3, 3)})),
     ["missing: d2t", "mis-shaped: lm_head.weight (3, 3)"]),
])
def test_bad_head_is_one_error_naming_every_bad_tensor(family3, tmp_path, edit, needles):
    bad = broken_copy(family3["eagle3"], tmp_path / "bad", edit)
    with pytest.raises(InvalidArgument) as err:
        load_head3(bad)
    assert all(n in str(err.value) for n in needles), str(err.value)


@pytest.mark.parametrize("head,drop", [("eagle3", ("t2d",)), ("eagle3-full", ("t2d",)), ("eagle3-full", ("t2d", "d2t"))])
def test_a_head_without_the_maps_engines_skip_loads_and_drafts_the_same(family3, tmp_path, head, drop):
    """Released heads may leave out t2d (training-only) and, with the whole
    vocabulary as draft vocabulary, d2t: those are rebuilt, and the head
    drafts the trees the complete checkpoint does."""
    lean = broken_copy(family3[head], tmp_path / "lean", lambda s: [s.pop(k) for k in drop])
    full, rebuilt = load_head3(family3[head]), load_head3(lean)
    assert torch.equal(rebuilt.d2t, full.d2t) and torch.equal(rebuilt.t2d, full.t2d)
    trees = []
    for directory in (family3[head], lean):
        drafter = Eagle3Drafter(directory, family3["target"])
        drafter.prefill("s", [5, 9, 14, 3], torch.randn(3, drafter.feature_size, generator=torch.Generator().manual_seed(1)))
        trees.append(drafter.draft("s", TreeParams(total_tokens=10, depth=4, expand_k=3)))
    assert trees[0].tokens.tolist() == trees[1].tokens.tolist()
    assert trees[0].parents.tolist() == trees[1].parents.tolist()


def test_d2t_that_does_not_map_to_distinct_target_ids_is_refused(family3, tmp_path):
    every_id_to_0 = (lambda s: s.update({"d2t": -torch.arange(s["d2t"].numel())}))
    bad = broken_copy(family3["eagle3"], tmp_path / "bad", every_id_to_0)
    with pytest.raises(InvalidArgument, match="d2t"):
        Eagle3Drafter(bad, family3["target"])


def test_head_for_another_vocabulary_is_refused(family3, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(family3["eagle3"], bad)
    config = read_config(bad)
    config["vocab_size"] += 1
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidArgument, match="t2d"):
        load_head3(bad)


def test_cli_reports_a_bad_head_in_one_line(family3, tmp_path, capsys):
    bad = broken_copy(family3["eagle3"], tmp_path / "bad", lambda s: s.pop("norm.weight"))
    code = main(["generate", "--local", "--target", str(family3["target"]), "--eagle", str(bad),
                 "--max-new-tokens", "4", "def "])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "missing: norm.weight" in err[0]


def test_cli_generates_with_an_eagle3_head_as_vanilla_does(family3, capsys):
    common = ["generate", "--local", "--target", str(family3["target"]), "--max-new-tokens", "12", "--json"]
    assert main([*common, "--method", "vanilla", "def add(a, b):"]) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for head in ("eagle3", "eagle3-full"):
        assert main([*common, "--eagle", str(family3[head]), "def add(a, b):"]) == 0
        got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert got["token_ids"] == plain["token_ids"], head
