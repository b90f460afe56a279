"""`specdec train medusa` on a tiny corpus and target: Medusa-1 heads start
from the target's lm_head, an interrupted run resumes bit-identically, the
heads load in the original or the vLLM layout and draft for the target."""

import json

import pytest
import torch

from drafter.medusa import load_medusa_drafter
from drafter.medusa_heads import load_heads
from specdec.cli.main import main
from specdec.train.medusa import head_weights

TEXT = "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\n\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("medusa-corpus")
    files = []
    for i in range(3):
        (d / f"mod{i}.py").write_text(TEXT * 20)
        files.append(str(d / f"mod{i}.py"))
    return files


def args(tiny_family, corpus, *extra):
    return ["train", "medusa", "--target", str(tiny_family["target"]), "--data", *corpus, "--steps", "6",
            "--batch", "2", "--seq-len", "24", "--eval-every", "6", "--ckpt-every", "2", "--heads", "3",
            "--threads", "1", "--no-progress", *extra]


def losses(workdir):
    return [h["loss"] for h in json.loads((workdir / "log.json").read_text())["history"]]


def test_heads_are_weighted_by_the_medusa_recipe():
    assert head_weights(3) == pytest.approx([0.2, 0.16, 0.128])


def test_interrupted_run_resumes_bit_identically_and_the_heads_load(tiny_family, corpus, tmp_path):
    a = args(tiny_family, corpus, "--workdir", str(tmp_path / "a"), "--out", str(tmp_path / "a_out"))
    assert main([*a, "--stop-after", "3"]) == 0
    assert len(losses(tmp_path / "a")) == 3 and not (tmp_path / "a_out").exists()
    assert main(a) == 0
    b = args(tiny_family, corpus, "--workdir", str(tmp_path / "b"), "--out", str(tmp_path / "b_out"),
             "--layout", "vllm")
    assert main(b) == 0
    assert losses(tmp_path / "a") == losses(tmp_path / "b") and len(losses(tmp_path / "b")) == 6
    assert (tmp_path / "a_out" / "medusa_lm_head.safetensors").is_file()
    assert json.loads((tmp_path / "b_out" / "config.json").read_text())["model_type"] == "medusa"
    x = torch.randn(4, 48)
    assert torch.equal(load_heads(tmp_path / "a_out")(x), load_heads(tmp_path / "b_out")(x))
    assert json.loads((tmp_path / "a_out" / "calibration.json").read_text())["greedy_value_temperature"] > 0
    drafter = load_medusa_drafter(tmp_path / "a_out", tiny_family["target"])
    assert drafter.num_heads == 3
