"""Hydra++ (``hydra_head_arch`` "prefix-mlp") heads as a drafter: a checkpoint
in the reference layout (``prefix_embeding_layer.*`` the state of a one-layer
``LlamaModel`` of the target's config, the heads' blocks between dropouts)
loads from ``.pt`` and ``.safetensors``, and its first level is head 0 over
that ``LlamaModel``'s output at the root's hidden state; greedy output is
token-identical to vanilla; the prefix layer's KV cache follows commits and
rollbacks (a session drafts the tree a fresh session fed the same committed
context drafts); bad prefix layers are refused at load in one line."""

import json
from copy import deepcopy

import pytest
import torch
from safetensors.torch import save_file
from trees import assert_same_tree

from drafter.hydra import load_hydra_drafter
from drafter.hydra_heads import HydraLoadError, load_heads, save_heads
from specdec.local import DrafterChoice, build_local, generate
from specdec.model import kv
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from tiny import tiny_hydra

PROMPTS = ([5, 6, 7, 8, 9], [20, 21, 22, 20, 21], [40, 3, 17, 40, 3, 17, 40])
CFG = TreeParams(method="eagle2", total_tokens=20, depth=3, expand_k=3)


@pytest.fixture(scope="module")
def target(tiny_family):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_family["target"]).eval()


def reference_state(heads) -> dict[str, torch.Tensor]:
    """``HydraPrefixMLP.state_dict()``'s keys and tensors for ``heads`` (two layers a head)."""
    p = heads.prefix
    layer = p.layers[0]
    state = {"prefix_embeding_layer.embed_tokens.weight": torch.zeros(heads.vocab, heads.hidden),   # unused
             "prefix_embeding_layer.norm.weight": p.norm.weight}
    for name, param in layer.named_parameters():
        state[f"prefix_embeding_layer.layers.0.{name}"] = param
    for i, mlp in enumerate(heads.hydra_mlp):
        for name, param in mlp[0].named_parameters():          # index 0 is a dropout
            state[f"hydra_mlp.{i}.1.{name}"] = param
        for name, param in mlp[1].named_parameters():          # dropout, block: 3
            state[f"hydra_mlp.{i}.3.{name}"] = param
        state[f"hydra_lm_head.{i}.1.weight"] = heads.hydra_lm_head[i].weight
        state[f"hydra_lm_head.{i}.1.bias"] = heads.hydra_lm_head[i].bias
    return {k: v.detach().clone().contiguous() for k, v in state.items()}


@pytest.fixture(scope="module")
def heads_dirs(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("hydra-prefix")
    heads = tiny_hydra(target, seed=7, num_heads=3, num_layers=2, prefix=True)
    config = {"hydra_num_heads": 3, "hydra_num_layers": 2, "hydra_head_arch": "prefix-mlp", "grounded_heads": True,
              "hidden_state_offset": 0, "base_model_name_or_path": "tiny"}
    for name, write in (("pt", lambda s, d: torch.save(s, d / "hydra_lm_head.pt")),
                        ("safetensors", lambda s, d: save_file(s, d / "hydra_lm_head.safetensors"))):
        (root / name).mkdir()
        write(reference_state(heads), root / name)
        (root / name / "config.json").write_text(json.dumps(config))
    return root, heads


@pytest.mark.parametrize("layout", ["pt", "safetensors"])
def test_the_reference_layout_loads_and_runs_the_prefix_layer(tiny_family, target, heads_dirs, layout):
    """Head 0's log-probs at the first draft are its logits over
    concat(LlamaModel(one layer of the target's config)(h)[t], E(root)), the
    reference's prefix layer built by transformers from the same keys."""
    from transformers import LlamaModel

    root, heads = heads_dirs
    loaded = load_heads(root / layout, target_config=target.config)
    assert (loaded.arch, loaded.num_heads, loaded.num_layers) == ("prefix-mlp", 3, 2)
    config = deepcopy(target.config)
    config.num_hidden_layers = 1
    reference = LlamaModel(config).eval()
    reference.load_state_dict({k.removeprefix("prefix_embeding_layer."): v for k, v in reference_state(heads).items()
                               if k.startswith("prefix_embeding_layer.")})
    drafter = load_hydra_drafter(root / layout, tiny_family["target"])
    feats, tokens = torch.randn(6, heads.hidden), [3, 9, 4, 1, 7, 12, 30]
    drafter.prefill("s", tokens, feats)
    drafter.draft("s", CFG)
    feature, first = drafter.sessions.get("s").state
    with torch.no_grad():
        want = reference(inputs_embeds=feats[None]).last_hidden_state[0, -1]
        logits = heads.head(0, want, target.get_input_embeddings().weight[[30]])
    assert torch.allclose(feature, want, atol=1e-5)
    assert torch.allclose(first, torch.log_softmax(logits, -1), atol=1e-5)


def test_our_layout_round_trips(target, heads_dirs, tmp_path):
    _, heads = heads_dirs
    save_heads(heads, tmp_path / "h")
    assert json.loads((tmp_path / "h" / "config.json").read_text())["hydra_head_arch"] == "prefix-mlp"
    loaded = load_heads(tmp_path / "h", target_config=target.config)
    h = torch.randn(1, 5, heads.hidden)
    e = torch.randn(1, 5, heads.hidden)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(loaded.teacher_forced(h, e), heads.teacher_forced(h, e)))


@pytest.fixture(scope="module")
def stack(tiny_family, heads_dirs):
    return build_local(ModelSpec(str(tiny_family["target"])), DrafterChoice("hydra", str(heads_dirs[0] / "pt")))


@pytest.mark.parametrize("cfg", [TreeParams(method="eagle2", total_tokens=12, depth=3, expand_k=3),
                                 TreeParams(method="static", total_tokens=32, depth=3)],
                         ids=["hydra", "hydra-static"])
def test_greedy_identical_to_vanilla(stack, cfg):
    stop = StopCriteria(max_new_tokens=40)
    accepted = 0
    for prompt in PROMPTS:
        want = generate(stack.verifier, None, list(prompt), SamplingParams(), stop, None).tokens
        got = generate(stack.verifier, stack.drafter, list(prompt), SamplingParams(), stop, cfg)
        assert got.tokens == want and len(want) == 40
        accepted += got.stats.accepted
    assert accepted > 0
    assert len(stack.drafter.sessions) == 0


def test_the_prefix_kv_follows_commits_and_rollbacks(tiny_family, heads_dirs):
    """Cycles of draft, a partly accepted commit and rollbacks: after each,
    the session's prefix KV holds exactly its committed hidden states, and
    its tree is the one a fresh session prefilled with the same committed
    context drafts (a KV slot of a rolled-back state would change it)."""
    drafter = load_hydra_drafter(heads_dirs[0] / "safetensors", tiny_family["target"])
    gen = torch.Generator().manual_seed(3)
    tokens, feats = [4, 8, 15, 16, 23], list(torch.randn(4, drafter.hidden_size, generator=gen))
    drafter.prefill("s", list(tokens), torch.stack(feats))

    def check():
        sess = drafter.sessions.get("s")
        assert sess.tokens == tokens
        got = drafter.draft("s", CFG)
        assert sess.fed == kv.seq_len(sess.cache) == len(tokens) - 1
        drafter.prefill("fresh", list(tokens), torch.stack(feats))
        assert_same_tree(got, drafter.draft("fresh", CFG))
        drafter.release("fresh")
        return got

    tree = check()
    for cycle in range(4):
        path = [int(tree.tokens[c]) for c in tree.children()[0][:1]]     # the first child accepted, then a bonus
        new = path + [(cycle * 7 + 1) % drafter.vocab_size]
        new_feats = list(torch.randn(len(new), drafter.hidden_size, generator=gen))
        drafter.commit("s", new, torch.stack(new_feats))
        tokens, feats = tokens + new, feats + new_feats
        tree = check()
        # a rollback into the context fed before, then another continuation: drafted
        # right after the rollback (the root's input fed again), or only after a longer commit
        keep = len(tokens) - 3
        drafter.rollback("s", keep)
        tokens, feats = tokens[:keep], feats[:keep - 1]
        if cycle % 2:
            tree = check()
        alt = [11, 12, 13, 14][:2 + 2 * (cycle % 2 == 0)]
        alt_feats = list(torch.randn(len(alt), drafter.hidden_size, generator=gen))
        drafter.commit("s", alt, torch.stack(alt_feats))
        tokens, feats = tokens + alt, feats + alt_feats
        tree = check()


def test_the_prefix_layer_reads_the_whole_context(tiny_family, heads_dirs):
    """Two sessions that differ only in an early hidden state draft different
    first levels: the heads read the prefix layer's attention over the context,
    not the last hidden state alone."""
    drafter = load_hydra_drafter(heads_dirs[0] / "pt", tiny_family["target"])
    feats = torch.randn(5, drafter.hidden_size)
    other = feats.clone()
    other[0] += 3.0
    for sid, f in (("a", feats), ("b", other)):
        drafter.prefill(sid, [1, 2, 3, 4, 5, 6], f)
        drafter.draft(sid, CFG)
    assert not torch.allclose(drafter.sessions.get("a").state[1], drafter.sessions.get("b").state[1], atol=1e-4)


def _bad(src, dst, edit, config=lambda c: c):
    dst.mkdir()
    state = edit(torch.load(src / "hydra_lm_head.pt", weights_only=True))
    torch.save(state, dst / "hydra_lm_head.pt")
    (dst / "config.json").write_text(json.dumps(config(json.loads((src / "config.json").read_text()))))
    return dst


Q = "prefix_embeding_layer.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("case,edit,message", [
    ("q-shape", lambda s: {**s, Q: torch.zeros(8, 48)}, f"{Q} has shape (8, 48), expected (48, 48) (the target's "
                                                        f"decoder layer: hidden size 48"),
    ("mlp-width", lambda s: {**s, "prefix_embeding_layer.layers.0.mlp.up_proj.weight": torch.zeros(7, 48)},
     "mlp.up_proj.weight has shape (7, 48)"),
    ("no-norm", lambda s: {k: v for k, v in s.items() if k != "prefix_embeding_layer.norm.weight"},
     "missing key prefix_embeding_layer.norm.weight"),
    ("no-layer", lambda s: {k: v for k, v in s.items() if ".layers.0." not in k},
     "missing key prefix_embeding_layer.layers.0."),
    ("two-layers", lambda s: {**s, "prefix_embeding_layer.layers.1.mlp.up_proj.weight": torch.zeros(7, 48)},
     "key prefix_embeding_layer.layers.1.mlp.up_proj.weight fits no head"),
    ("mlp-keys", lambda s: {**s, "hydra_mlp.0.0.linear.weight": torch.zeros(48, 96)},
     "unexpected keys for the Hydra prefix-mlp layout: hydra_mlp.0.0.linear.weight"),
    ("narrow", lambda s: {k: (v[..., :24] if k.startswith("hydra_lm_head") and k.endswith("weight") else v)
                          for k, v in s.items()}, "hidden size 24 does not match the target's 48"),
])
def test_bad_prefix_layers_are_refused_at_load_in_one_line(tiny_family, heads_dirs, tmp_path, case, edit, message):
    bad = _bad(heads_dirs[0] / "pt", tmp_path / case, edit)
    with pytest.raises(HydraLoadError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        load_hydra_drafter(bad, tiny_family["target"])
    assert "\n" not in str(err.value)


def test_prefix_heads_need_the_target_config(heads_dirs):
    with pytest.raises(HydraLoadError, match="prefix-mlp heads need the target's config"):
        load_heads(heads_dirs[0] / "pt")


def test_the_prefix_layer_is_the_targets_decoder_layer():
    """For a target with grouped KV heads, its own head width, MLP width and
    rope theta, the prefix layer is the reference's one-layer ``LlamaModel`` of
    that config: same keys and shapes, same output at far positions."""
    from transformers import LlamaConfig, LlamaModel

    from drafter.hydra_prefix import PrefixLayer, prefix_config

    target = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                         intermediate_size=96, rope_theta=5000.0, rms_norm_eps=1e-5, vocab_size=50)
    config = deepcopy(target)
    config.num_hidden_layers = 1
    torch.manual_seed(0)
    reference = LlamaModel(config).eval()
    layer = PrefixLayer(prefix_config(target)).eval()
    state = {k: v for k, v in reference.state_dict().items() if k != "embed_tokens.weight"}
    assert {k: v.shape for k, v in layer.state_dict().items()} == {k: v.shape for k, v in state.items()}
    layer.load_state_dict(state)
    h = torch.randn(1, 6, 64)
    positions = torch.arange(300, 306)[None]
    with torch.no_grad():
        want = reference(inputs_embeds=h, position_ids=positions).last_hidden_state
        assert torch.allclose(layer(h, positions), want, atol=1e-5)
