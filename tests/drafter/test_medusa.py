"""Medusa heads as a drafter: both checkpoint layouts load to the same heads
and draft the same trees; heads that do not fit are refused at load in one
line naming what does not fit; greedy output is token-identical to vanilla
for the dynamic and the static (mc_sim_7b_63) trees."""

from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafter.medusa import MedusaDrafter, load_medusa_drafter
from drafter.medusa_heads import MedusaLoadError, load_heads, save_heads
from specdec.local import DrafterChoice, build_local, generate
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from specdec.request.tree_shapes import MEDUSA_MC_SIM_7B_63, check_shape, shape_from_choices
from tiny import tiny_medusa

PROMPTS = ([5, 6, 7, 8, 9], [20, 21, 22, 20, 21], [40, 3, 17, 40, 3, 17, 40])
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def target(tiny_family):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_family["target"]).eval()


@pytest.fixture(scope="module")
def heads_dirs(tiny_family, target, tmp_path_factory):
    """The same random heads in both layouts (4 heads, 2 blocks each)."""
    root = tmp_path_factory.mktemp("medusa")
    heads = tiny_medusa(target, seed=3, num_heads=4, num_layers=2)
    save_heads(heads, root / "original", "original")
    save_heads(heads, root / "vllm", "vllm")
    return {"original": root / "original", "vllm": root / "vllm", "heads": heads}


def test_mc_sim_7b_63_has_the_published_shape():
    check_shape(MEDUSA_MC_SIM_7B_63)
    assert len(MEDUSA_MC_SIM_7B_63) == 63
    assert Counter(map(len, MEDUSA_MC_SIM_7B_63)) == {1: 10, 2: 28, 3: 23, 4: 2}


def test_choices_lists_become_shapes_in_parent_order():
    assert shape_from_choices([[0, 0], [0], [1]]) == ((0,), (1,), (0, 0))
    with pytest.raises(ValueError, match="parent path"):
        shape_from_choices([[0], [1, 0]])
    with pytest.raises(ValueError, match="list of rank paths"):
        shape_from_choices({"choices": [[0]]})


def test_both_layouts_load_the_same_heads(heads_dirs):
    a, b = load_heads(heads_dirs["original"]), load_heads(heads_dirs["vllm"])
    assert (a.num_heads, a.num_layers) == (b.num_heads, b.num_layers) == (4, 2)
    x = torch.randn(3, a.hidden)
    assert torch.equal(a(x), b(x))
    assert torch.equal(a(x), heads_dirs["heads"](x))


def test_heads_are_counted_from_the_keys_not_the_config(heads_dirs, tmp_path):
    import json
    import shutil

    shutil.copytree(heads_dirs["original"], tmp_path / "h")
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    (tmp_path / "h" / "config.json").write_text(json.dumps({**config, "medusa_num_heads": 2}))
    assert load_heads(tmp_path / "h").num_heads == 4


def test_a_pt_file_loads_too(heads_dirs, tmp_path):
    state = load_file(heads_dirs["original"] / "medusa_lm_head.safetensors")
    tmp_path.joinpath("h").mkdir()
    torch.save(state, tmp_path / "h" / "medusa_lm_head.pt")
    x = torch.randn(2, heads_dirs["heads"].hidden)
    assert torch.equal(load_heads(tmp_path / "h")(x), heads_dirs["heads"](x))


@pytest.mark.parametrize("method", ["eagle2", "static"])
@pytest.mark.parametrize("sampled", [False, True])
def test_both_layouts_draft_identical_trees(tiny_family, heads_dirs, method, sampled):
    feats = torch.randn(5, heads_dirs["heads"].hidden)
    sampling = SamplingParams(temperature=1.0, seed=7) if sampled else None
    cfg = TreeParams(method=method, total_tokens=24, depth=4, expand_k=3)
    trees = []
    for layout in ("original", "vllm"):
        drafter = load_medusa_drafter(heads_dirs[layout], tiny_family["target"])
        drafter.prefill("s", [1, 2, 3, 4, 5, 6], feats, sampling=sampling)
        trees.append(drafter.draft("s", cfg))
    a, b = trees
    assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
    assert torch.equal(a.values, b.values)
    assert a.size == 24 if not sampled else a.size > 1
    assert bool(a.proposals) == sampled


def test_the_tree_reads_head_d_at_depth_d_plus_one(tiny_family, heads_dirs):
    drafter = load_medusa_drafter(heads_dirs["original"], tiny_family["target"])
    feats = torch.randn(3, drafter.hidden_size)
    drafter.prefill("s", [1, 2, 3, 4], feats)
    tree = drafter.draft("s", TreeParams(method="chain", total_tokens=8, depth=8))
    want = heads_dirs["heads"](feats[-1]).argmax(-1).tolist()      # one token per head
    assert tree.tokens.tolist() == [4] + want                      # as deep as there are heads
    static = drafter.draft("s", TreeParams(method="static", total_tokens=64, depth=8))
    assert static.size == 64 and int(static.depths.max()) == 4     # mc_sim_7b_63 whole


def _corrupt(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    name = "medusa_lm_head.safetensors" if (src / "medusa_lm_head.safetensors").is_file() else "model.safetensors"
    state = edit(dict(load_file(src / name)))
    if state:
        save_file(state, dst / name)
    return dst


@pytest.mark.parametrize("case,layout,edit,message", [
    ("missing-bias", "original", lambda s: {k: v for k, v in s.items() if k != "1.0.linear.bias"},
     "missing key 1.0.linear.bias"),
    ("missing-lm-head", "vllm", lambda s: {k: v for k, v in s.items() if k != "lm_heads.3.weight"},
     "missing key lm_heads.3.weight"),
    ("a-gap", "original", lambda s: {k: v for k, v in s.items() if not k.startswith("1.")}, "head 1 is missing"),
    ("no-heads", "vllm", lambda s: {"token_map": torch.arange(3)}, "head count 0"),
    ("stray-key", "original", lambda s: {**s, "0.2.bias": torch.zeros(3)}, "fit no head"),
    ("bad-shape", "vllm", lambda s: {**s, "blocks.0.layers.0.weight": torch.zeros(5, 5)},
     "blocks.0.0.linear.weight has shape"),
    ("unknown-keys", "original", lambda s: {"fc.weight": torch.zeros(2, 2)}, "unexpected keys"),
])
def test_bad_heads_are_refused_at_load_in_one_line(tiny_family, heads_dirs, tmp_path, case, layout, edit, message):
    bad = _corrupt(heads_dirs[layout], tmp_path / case, edit)
    with pytest.raises(MedusaLoadError, match=message) as err:
        load_medusa_drafter(bad, tiny_family["target"])
    assert "\n" not in str(err.value)


def test_an_unknown_layout_is_refused(tiny_family, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(MedusaLoadError, match="unknown layout"):
        load_medusa_drafter(tmp_path, tiny_family["target"])


@pytest.mark.parametrize("hidden,vocab,message", [(24, None, "hidden size 24 does not match the target's 48"),
                                                  (None, 17, "vocabulary 17 does not match")])
def test_heads_for_another_target_are_refused(tiny_family, target, tmp_path, hidden, vocab, message):
    from drafter.medusa_heads import MedusaHeads

    heads = MedusaHeads(hidden or target.config.hidden_size, vocab or target.config.vocab_size, 2)
    save_heads(heads, tmp_path / "h")
    with pytest.raises(MedusaLoadError, match=message):
        load_medusa_drafter(tmp_path / "h", tiny_family["target"])


def test_a_token_map_names_target_ids(target):
    from drafter.medusa_heads import MedusaHeads

    vocab = target.config.vocab_size
    heads = MedusaHeads(target.config.hidden_size, 3, 1, token_map=torch.tensor([4, 9, 2]))
    drafter = MedusaDrafter("unused", heads=heads, target=(target.config.hidden_size, vocab))
    drafter.prefill("s", [1, 2], torch.randn(1, target.config.hidden_size))
    tree = drafter.draft("s", TreeParams(method="eagle2", total_tokens=4, depth=1, expand_k=3))
    assert sorted(tree.tokens[1:].tolist()) == [2, 4, 9]


@pytest.fixture(scope="module")
def stack(tiny_family, heads_dirs):
    return build_local(ModelSpec(str(tiny_family["target"])), DrafterChoice("medusa", str(heads_dirs["original"])))


@pytest.mark.parametrize("cfg", [TreeParams(method="eagle2", total_tokens=12, depth=6, expand_k=3),
                                 TreeParams(method="static", total_tokens=64, depth=6)],
                         ids=["medusa", "medusa-static"])
def test_greedy_identical_to_vanilla(stack, cfg):
    stop = StopCriteria(max_new_tokens=NEW_TOKENS)
    for prompt in PROMPTS:
        want = generate(stack.verifier, None, list(prompt), SamplingParams(), stop, None).tokens
        got = generate(stack.verifier, stack.drafter, list(prompt), SamplingParams(), stop, cfg)
        assert got.tokens == want and len(want) == NEW_TOKENS
        assert got.stats.drafted > 0
    assert len(stack.drafter.sessions) == 0


def test_the_drafter_reads_the_final_norm_hidden_state_the_verifier_ships(stack, target):
    """Medusa heads read the target's last hidden state after its final norm:
    the features a verifier returns for drafters without feature layers."""
    prompt = [5, 6, 7, 8, 9]
    first = stack.verifier.prefill("f", prompt, SamplingParams())
    stack.verifier.release("f")
    with torch.no_grad():
        normed = target.model(torch.tensor([prompt])).last_hidden_state[0]
    assert torch.allclose(first.features, normed, atol=1e-5)
    stack.drafter.prefill("f", prompt + [first.token], first.features)
    tree = stack.drafter.draft("f", TreeParams(method="chain", total_tokens=8, depth=8))
    stack.drafter.release("f")
    assert tree.tokens[1:].tolist() == stack.drafter.heads(normed[-1]).argmax(-1).tolist()
