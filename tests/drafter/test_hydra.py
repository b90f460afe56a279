"""Hydra heads as a drafter: the reference layout loads (a ``.pt`` with the
model's ``hydra_head.`` prefix too); heads that do not fit are refused at load
in one line naming what does not fit (an unknown ``hydra_head_arch`` among
them; prefix-mlp heads: tests/drafter/test_hydra_prefix.py); every node's children come from the head for its depth fed with that
node's own path; greedy output is token-identical to vanilla for the dynamic
and the static tree."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafter.hydra import HydraDrafter, load_hydra_drafter
from drafter.hydra_heads import HydraHeads, HydraLoadError, load_heads, save_heads
from specdec.local import DrafterChoice, build_local, generate
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from tiny import tiny_hydra

PROMPTS = ([5, 6, 7, 8, 9], [20, 21, 22, 20, 21], [40, 3, 17, 40, 3, 17, 40])
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def target(tiny_family):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_family["target"]).eval()


@pytest.fixture(scope="module")
def heads_dir(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("hydra")
    heads = tiny_hydra(target, seed=3, num_heads=4, num_layers=2)
    save_heads(heads, root / "h")
    return root / "h", heads


def test_the_reference_layout_round_trips(heads_dir):
    path, heads = heads_dir
    loaded = load_heads(path)
    assert (loaded.num_heads, loaded.num_layers) == (4, 2)
    config = json.loads((path / "config.json").read_text())
    assert (config["hydra_num_heads"], config["hydra_num_layers"], config["hydra_head_arch"]) == (4, 2, "mlp")
    h, e = torch.randn(3, heads.hidden), torch.randn(3, 3, heads.hidden)
    assert torch.equal(loaded.head(2, h, e), heads.head(2, h, e))


def test_a_pt_file_with_the_models_prefix_loads(heads_dir, tmp_path):
    path, heads = heads_dir
    state = {f"hydra_head.{k}": v for k, v in load_file(path / "hydra_lm_head.safetensors").items()}
    (tmp_path / "h").mkdir()
    torch.save(state, tmp_path / "h" / "hydra_lm_head.pt")
    h, e = torch.randn(heads.hidden), torch.randn(1, heads.hidden)
    assert torch.equal(load_heads(tmp_path / "h").head(0, h, e), heads.head(0, h, e))


def _corrupt(src: Path, dst: Path, edit=lambda s: s, config=lambda c: c) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(config(json.loads((src / "config.json").read_text()))))
    state = edit(dict(load_file(src / "hydra_lm_head.safetensors")))
    if state:
        save_file(state, dst / "hydra_lm_head.safetensors")
    return dst


@pytest.mark.parametrize("case,edit,config,message", [
    ("mlp-as-prefix", None, lambda c: {**c, "hydra_head_arch": "prefix-mlp"},
     "unexpected keys for the Hydra prefix-mlp layout: hydra_lm_head.0.bias"),
    ("unknown-arch", None, lambda c: {**c, "hydra_head_arch": "cross-attn"}, "hydra_head_arch 'cross-attn'"),
    ("offset", None, lambda c: {**c, "hidden_state_offset": 2}, "hidden_state_offset 2"),
    ("head-count", None, lambda c: {**c, "hydra_num_heads": 3}, "hydra_num_heads 3, the weights hold 4"),
    ("layer-count", None, lambda c: {**c, "hydra_num_layers": 1}, "hydra_num_layers 1, the weights hold 2"),
    ("missing-res", lambda s: {k: v for k, v in s.items() if k != "hydra_mlp.1.0.res_connection.weight"}, None,
     "missing key hydra_mlp.1.0.res_connection.weight"),
    ("a-gap", lambda s: {k: v for k, v in s.items() if not k.startswith("hydra_lm_head.1.")}, None,
     "head 1 is missing"),
    ("bad-shape", lambda s: {**s, "hydra_mlp.2.0.linear.weight": torch.zeros(5, 5)}, None,
     "hydra_mlp.2.0.linear.weight has shape"),
    ("unknown-keys", lambda s: {**s, "prefix_embeding_layer.norm.weight": torch.zeros(2)}, None, "unexpected keys"),
    ("no-weights", lambda s: {}, None, "not a Hydra heads directory"),
])
def test_bad_heads_are_refused_at_load_in_one_line(tiny_family, heads_dir, tmp_path, case, edit, config, message):
    bad = _corrupt(heads_dir[0], tmp_path / case, edit or (lambda s: s), config or (lambda c: c))
    with pytest.raises(HydraLoadError, match=message) as err:
        load_hydra_drafter(bad, tiny_family["target"])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("hidden,vocab,message", [(24, None, "hidden size 24 does not match the target's 48"),
                                                  (None, 17, "vocabulary 17 does not match")])
def test_heads_for_another_target_are_refused(tiny_family, target, tmp_path, hidden, vocab, message):
    save_heads(HydraHeads(hidden or target.config.hidden_size, vocab or target.config.vocab_size, 2), tmp_path / "h")
    with pytest.raises(HydraLoadError, match=message):
        load_hydra_drafter(tmp_path / "h", tiny_family["target"])


def test_each_node_is_expanded_from_its_own_path(tiny_family, heads_dir, target):
    """The children of every node are head d's top tokens for that node's path
    (root first): heads that ignored the path embeddings, or were fed another
    node's path, draft other trees."""
    path, heads = heads_dir
    drafter = load_hydra_drafter(path, tiny_family["target"])
    feats = torch.randn(4, drafter.hidden_size)
    drafter.prefill("s", [1, 2, 3, 4, 5], feats)
    tree = drafter.draft("s", TreeParams(method="eagle2", total_tokens=30, depth=3, expand_k=3))
    embed = target.get_input_embeddings().weight.detach()
    toks, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()

    def path_of(node):
        return path_of(parents[node]) + [toks[node]] if node >= 0 else []

    differs, checked = 0, 0
    for node in range(len(toks)):
        kids = sorted(toks[c] for c in range(len(toks)) if parents[c] == node)
        if not kids:
            continue
        route = torch.tensor(path_of(node))
        with torch.no_grad():
            logits = heads.head(depths[node], feats[-1], embed[route])
            blind = heads.head(depths[node], feats[-1], embed[torch.zeros_like(route)])
        assert set(kids) <= set(logits.topk(3).indices.tolist())
        differs += not set(kids) <= set(blind.topk(3).indices.tolist())
        checked += 1
    assert checked >= 4 and differs > 0        # the path changes what gets drafted
    assert int(tree.depths.max()) == 3


def test_heads_read_the_path(heads_dir):
    """Two paths that differ only below the root give head 1 different distributions."""
    path, heads = heads_dir
    drafter = HydraDrafter(path, heads=heads, embed=torch.randn(heads.vocab, heads.hidden))
    feature = torch.randn(heads.hidden)
    rows = drafter.head_logprobs(1, feature, torch.tensor([[7, 8], [7, 9], [7, 8]]))
    assert torch.equal(rows[0], rows[2]) and not torch.allclose(rows[0], rows[1], atol=1e-3)


@pytest.fixture(scope="module")
def stack(tiny_family, heads_dir):
    return build_local(ModelSpec(str(tiny_family["target"])), DrafterChoice("hydra", str(heads_dir[0])))


@pytest.mark.parametrize("cfg", [TreeParams(method="eagle2", total_tokens=12, depth=6, expand_k=3),
                                 TreeParams(method="static", total_tokens=64, depth=6)],
                         ids=["hydra", "hydra-static"])
def test_greedy_identical_to_vanilla(stack, cfg):
    stop = StopCriteria(max_new_tokens=NEW_TOKENS)
    for prompt in PROMPTS:
        want = generate(stack.verifier, None, list(prompt), SamplingParams(), stop, None).tokens
        got = generate(stack.verifier, stack.drafter, list(prompt), SamplingParams(), stop, cfg)
        assert got.tokens == want and len(want) == NEW_TOKENS
        assert got.stats.drafted > 0
    assert len(stack.drafter.sessions) == 0
