"""`specdec train hydra` on a tiny corpus and target: an interrupted run
resumes bit-identically, the heads are written in the reference layout and
draft for the target; head i is trained on the target's next token after
the ground-truth path t + 1 .. t + 1 + i."""

import json

import pytest
import torch

from drafter.hydra import load_hydra_drafter
from drafter.hydra_heads import HydraHeads, load_heads
from specdec.cli.main import main
from specdec.train.hydra import hydra_losses

TEXT = "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\n\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("hydra-corpus")
    files = []
    for i in range(3):
        (d / f"mod{i}.py").write_text(TEXT * 20)
        files.append(str(d / f"mod{i}.py"))
    return files


def args(tiny_family, corpus, *extra):
    return ["train", "hydra", "--target", str(tiny_family["target"]), "--data", *corpus, "--steps", "6",
            "--batch", "2", "--seq-len", "24", "--eval-every", "6", "--ckpt-every", "2", "--heads", "3",
            "--threads", "1", "--no-progress", *extra]


def losses(workdir):
    return [h["loss"] for h in json.loads((workdir / "log.json").read_text())["history"]]


def test_head_i_reads_the_path_and_is_scored_on_the_token_after_it():
    torch.manual_seed(0)
    heads = HydraHeads(4, 6, 2)
    embed = torch.randn(6, 4)
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    feats = torch.randn(1, 5, 4)
    labels = torch.tensor([[2, 3, 4, 5, 0]])
    _, metrics = hydra_losses(heads, embed, tokens, feats, labels)
    with torch.no_grad():          # head 1 at t = 0 reads E(tokens[1]), E(tokens[2]) and predicts labels[2]
        logits = heads.head(1, feats[0, 0], embed[tokens[0, 1:3]])
    outs = heads.teacher_forced(feats, embed[tokens])
    assert [o.shape[1] for o in outs] == [4, 3]
    assert torch.allclose(outs[1][0, 0], logits, atol=1e-6)
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(outs[1][0], labels[0, 2:])
    assert metrics["ce1"] == pytest.approx(float(want))


def test_interrupted_run_resumes_bit_identically_and_the_heads_load(tiny_family, corpus, tmp_path):
    a = args(tiny_family, corpus, "--workdir", str(tmp_path / "a"), "--out", str(tmp_path / "a_out"))
    assert main([*a, "--stop-after", "3"]) == 0
    assert len(losses(tmp_path / "a")) == 3 and not (tmp_path / "a_out").exists()
    assert main(a) == 0
    b = args(tiny_family, corpus, "--workdir", str(tmp_path / "b"), "--out", str(tmp_path / "b_out"))
    assert main(b) == 0
    assert losses(tmp_path / "a") == losses(tmp_path / "b") and len(losses(tmp_path / "b")) == 6
    config = json.loads((tmp_path / "a_out" / "config.json").read_text())
    assert (config["hydra_num_heads"], config["hydra_num_layers"], config["hydra_head_arch"]) == (3, 1, "mlp")
    h, e = torch.randn(2, 48), torch.randn(2, 3, 48)
    assert torch.equal(load_heads(tmp_path / "a_out").head(2, h, e), load_heads(tmp_path / "b_out").head(2, h, e))
    assert json.loads((tmp_path / "a_out" / "calibration.json").read_text())["greedy_value_temperature"] > 0
    assert load_hydra_drafter(tmp_path / "a_out", tiny_family["target"]).num_heads == 3


def test_untrained_prefix_mlp_heads_guess_what_the_mlp_ones_do(tiny_family):
    """The prefix layer starts as its final norm of h_t (its output projections
    zero): h_t rescaled, so head 0's top guesses are the plain heads'."""
    from transformers import AutoModelForCausalLM

    from specdec.train.hydra import HydraOptions, heads_from_target

    target = AutoModelForCausalLM.from_pretrained(tiny_family["target"])
    plain = heads_from_target(target, HydraOptions(num_heads=2))
    prefix = heads_from_target(target, HydraOptions(num_heads=2, arch="prefix-mlp"))
    feats, embeds = torch.randn(2, 7, 48), torch.randn(2, 7, 48)
    with torch.no_grad():
        want, got = plain.teacher_forced(feats, embeds)[0], prefix.teacher_forced(feats, embeds)[0]
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_prefix_mlp_heads_resume_bit_identically_in_the_reference_layout(tiny_family, corpus, tmp_path):
    from safetensors import safe_open
    from transformers import AutoConfig

    a = args(tiny_family, corpus, "--arch", "prefix-mlp", "--workdir", str(tmp_path / "a"), "--out",
             str(tmp_path / "a_out"))
    assert main([*a, "--stop-after", "3"]) == 0
    assert main(a) == 0
    b = args(tiny_family, corpus, "--arch", "prefix-mlp", "--workdir", str(tmp_path / "b"), "--out",
             str(tmp_path / "b_out"))
    assert main(b) == 0
    assert losses(tmp_path / "a") == losses(tmp_path / "b") and len(losses(tmp_path / "b")) == 6
    assert json.loads((tmp_path / "a_out" / "config.json").read_text())["hydra_head_arch"] == "prefix-mlp"
    with safe_open(tmp_path / "a_out" / "hydra_lm_head.safetensors", "pt") as f:
        keys = set(f.keys())
    assert {"prefix_embeding_layer.layers.0.self_attn.q_proj.weight", "prefix_embeding_layer.norm.weight",
            "hydra_mlp.0.1.linear.weight", "hydra_lm_head.2.1.bias"} <= keys
    config = AutoConfig.from_pretrained(tiny_family["target"])
    h, e = torch.randn(1, 4, 48), torch.randn(1, 4, 48)
    with torch.no_grad():
        outs = [load_heads(tmp_path / d, target_config=config).teacher_forced(h, e) for d in ("a_out", "b_out")]
    assert all(torch.equal(x, y) for x, y in zip(*outs))
    assert load_hydra_drafter(tmp_path / "a_out", tiny_family["target"]).heads.arch == "prefix-mlp"
