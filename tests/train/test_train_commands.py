"""`specdec train ...` on a tiny corpus: deterministic, loss goes down, artifacts load."""

import json

import pytest
import torch

from specdec.cli.main import main
from specdec.train.corpus import is_heldout, stdlib_split

CORPUS = [
    "def add(a, b):\n    return a + b\n\n",
    "def sub(a, b):\n    return a - b\n\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n",
    "for i in range(10):\n    print(i * i)\n\n",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    files = []
    for i in range(6):
        f = d / f"mod{i}.py"
        f.write_text("".join(CORPUS[(i + j) % 4] for j in range(30)))
        files.append(str(f))
    return files


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("trained")
    tiny = ["--steps", "30", "--batch", "4", "--seq-len", "32", "--eval-every", "30", "--no-progress",
            "--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads", "2", "--intermediate", "64", "--threads", "1"]
    assert main(["train", "tokenizer", "--data", *corpus, "--out", str(root / "tok"), "--vocab-size", "300"]) == 0
    assert main(["train", "target", "--data", *corpus, "--tokenizer", str(root / "tok"), "--out", str(root / "target"),
                 "--workdir", str(root / "wt"), *tiny]) == 0
    assert main(["train", "draft-lm", "--data", *corpus, "--tokenizer", str(root / "tok"),
                 "--out", str(root / "draft"), "--workdir", str(root / "wd"), *tiny]) == 0
    assert main(["train", "eagle", "--data", *corpus, "--target", str(root / "target"), "--out", str(root / "eagle"),
                 "--workdir", str(root / "we"), *tiny[:9], "--threads", "1"]) == 0
    return root


def losses(workdir):
    log = json.loads((workdir / "log.json").read_text())
    return [h["loss"] for h in log["history"]]


def test_tokenizer_round_trips(trained):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(trained / "tok")
    for text in ["def add(a, b):\n    return a + b\n", "ünïcode ✓ 中文 😀", "    \t\n"]:
        assert tok.decode(tok(text)["input_ids"]) == text


@pytest.mark.parametrize("name", ["wt", "wd", "we"])
def test_loss_goes_down(trained, name):
    history = losses(trained / name)
    assert len(history) == 30
    assert sum(history[-5:]) / 5 < sum(history[:5]) / 5 * 0.9


def test_artifacts_load_through_public_loaders(trained):
    from transformers import AutoModelForCausalLM

    from drafter.eagle.eagle2 import EagleDrafter
    from specdec.request.params import TreeParams

    for name in ("target", "draft"):
        model = AutoModelForCausalLM.from_pretrained(trained / name, dtype=torch.float32)
        assert model.config.num_hidden_layers == 2
    drafter = EagleDrafter(trained / "eagle", trained / "target")
    drafter.prefill("s", [1, 2, 3], torch.randn(2, drafter.hidden_size))
    assert drafter.draft("s", TreeParams(total_tokens=6, depth=2, expand_k=2)).size == 6


def test_eagle_head_ships_its_fitted_value_temperature(trained, corpus, capsys):
    from drafter.eagle.eagle2 import EagleDrafter
    from specdec.train.eagle import TEMPERATURE_GRID

    written = json.loads((trained / "eagle" / "calibration.json").read_text())
    assert written["greedy_value_temperature"] in TEMPERATURE_GRID
    assert EagleDrafter(trained / "eagle", trained / "target").greedy_value_temperature == \
        written["greedy_value_temperature"]
    (trained / "eagle" / "calibration.json").unlink()
    assert main(["train", "calibrate", "--target", str(trained / "target"), "--eagle", str(trained / "eagle"),
                 "--data", *corpus, "--seq-len", "32"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == json.loads((trained / "eagle" / "calibration.json").read_text())
    assert printed["greedy_value_temperature"] == written["greedy_value_temperature"]   # deterministic


@pytest.mark.parametrize("true_t", [0.4, 1.0, 1.6])
def test_temperature_fit_recovers_the_temperature_labels_were_drawn_at(true_t):
    from specdec.train.eagle import fit_value_temperature

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(20000, 12, generator=gen) * 2
    labels = torch.multinomial(torch.softmax(logits / true_t, -1), 1, generator=gen)[:, 0]
    fitted, nll = fit_value_temperature(logits, labels)
    assert abs(fitted - true_t) <= 0.1
    assert nll[fitted] == min(nll.values())


def test_interrupted_run_resumes_bit_identically(tmp_path, corpus, trained):
    """Stopped after 12 of 20 steps and rerun, a run ends exactly where an
    uninterrupted run ends: same data order, same optimizer state."""
    args = ["train", "target", "--data", *corpus, "--tokenizer", str(trained / "tok"), "--no-progress",
            "--steps", "20", "--batch", "4", "--seq-len", "32", "--eval-every", "100", "--hidden", "32",
            "--layers", "2", "--heads", "2", "--kv-heads", "2", "--intermediate", "64", "--threads", "1", "--ckpt-every", "5"]
    assert main([*args, "--workdir", str(tmp_path / "a"), "--out", str(tmp_path / "a_out"), "--stop-after", "12"]) == 0
    assert len(losses(tmp_path / "a")) == 12
    assert not (tmp_path / "a_out").exists()           # only a finished model is exported
    assert main([*args, "--workdir", str(tmp_path / "a"), "--out", str(tmp_path / "a_out")]) == 0
    assert main([*args, "--workdir", str(tmp_path / "b"), "--out", str(tmp_path / "b_out")]) == 0
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert (tmp_path / "a_out" / "model.safetensors").is_file()


def test_corpus_split_is_deterministic():
    a, b = stdlib_split(), stdlib_split()
    assert a.train == b.train and a.heldout == b.heldout
    assert all(is_heldout(p.relative_to(a.root).as_posix()) for p in a.heldout)
    assert 0.02 < len(a.heldout) / (len(a.train) + len(a.heldout)) < 0.1


def test_model_card_is_measured_from_the_family(tiny_family, tmp_path, monkeypatch):
    """`specdec train card` on a (tiny) family: numbers come from the models, plot is a PNG."""
    import shutil

    import specdec.train.card as card

    for name in ("target", "eagle", "draft-lm"):
        shutil.copytree(tiny_family[name], tmp_path / name)
    monkeypatch.setattr(card, "heldout_prompts", lambda tok, n: [[5, 6, 7, 8], [9, 10, 11, 12]])
    assert main(["train", "card", "--demo", str(tmp_path), "--max-new-tokens", "8"]) == 0
    text = (tmp_path / "MODEL_CARD.md").read_text()
    data = json.loads((tmp_path / "card.json").read_text())
    assert data["step_costs"]["target_token_s"] > 0 and data["step_costs"]["head_step_1_s"] > 0
    assert data["models"]["target"]["params"] == sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM
                                                     .from_pretrained(tmp_path / "target").parameters())
    assert sum(b["nodes"] for b in data["heldout"]["calibration"]) > 0
    assert "| confidence | nodes | accepted | rate |" in text
    assert (tmp_path / "calibration.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
