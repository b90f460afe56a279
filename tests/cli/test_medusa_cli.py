"""``--medusa DIR`` on the command line: ``generate --local`` matches vanilla
with the dynamic and the static tree (a choices file too); heads that do not
fit are one line and exit status 2, for ``generate`` and ``drafter serve``
(which refuses to start)."""

import json

import pytest
import torch

from specdec.cli.main import main
from tiny import tiny_medusa


@pytest.fixture(scope="module")
def heads(tiny_family, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from drafter.medusa_heads import MedusaHeads, save_heads

    root = tmp_path_factory.mktemp("medusa-cli")
    target = AutoModelForCausalLM.from_pretrained(tiny_family["target"])
    save_heads(tiny_medusa(target, seed=5), root / "good")
    save_heads(MedusaHeads(24, target.config.vocab_size, 2), root / "narrow")
    (root / "choices.json").write_text(json.dumps([[0], [1], [0, 0], [0, 1], [0, 0, 0]]))
    return root


def generate(capsys, tiny_family, *flags):
    code = main(["generate", "--local", "--json", "--max-new-tokens", "16", "--target", str(tiny_family["target"]),
                 *flags, "def add(a, b):"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("flags", [["--method", "eagle2"], ["--method", "static"],
                                   ["--method", "static", "--medusa-choices", "CHOICES"]],
                         ids=["medusa", "medusa-static", "choices-file"])
def test_generate_local_matches_vanilla(tiny_family, heads, capsys, flags):
    flags = [str(heads / "choices.json") if f == "CHOICES" else f for f in flags]
    code, out, _ = generate(capsys, tiny_family, "--medusa", str(heads / "good"), *flags)
    assert code == 0
    _, ref, _ = generate(capsys, tiny_family, "--method", "vanilla")
    assert json.loads(out)["token_ids"] == json.loads(ref)["token_ids"]


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_heads_that_do_not_fit_exit_2_in_one_line(tiny_family, heads, capsys, command):
    if command == "generate":
        code, _, err = generate(capsys, tiny_family, "--medusa", str(heads / "narrow"))
    else:
        code = main(["drafter", "serve", "--medusa", str(heads / "narrow"), "--target", str(tiny_family["target"]),
                     "--port", "0"])
        err = capsys.readouterr().err
    assert code == 2
    assert "hidden size 24 does not match the target's 48" in err and len(err.strip().splitlines()) == 1


def test_a_bad_choices_file_is_one_line(tiny_family, heads, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("[[0], [2, 1]]")
    code, _, err = generate(capsys, tiny_family, "--medusa", str(heads / "good"), "--medusa-choices", str(bad))
    assert code == 2 and "parent path (2,) must come earlier" in err


def test_up_hands_the_heads_to_its_drafter_service(tiny_family, heads):
    from specdec.cli.main import build_parser
    from specdec.cli.up import _model_argv

    choices = str(heads / "choices.json")
    args = build_parser().parse_args(["up", "--target", str(tiny_family["target"]), "--medusa", str(heads / "good"),
                                      "--medusa-choices", choices])
    verifier, drafter, _ = _model_argv(args)
    assert drafter[:8] == ["--medusa", str(heads / "good"), "--target", str(tiny_family["target"]), "--dtype",
                           "float32", "--medusa-choices", choices]
    assert drafter[8:10] == ["--tokenizer", str(tiny_family["target"])]     # constrained drafts follow the grammar
    assert "--compile-feature-layers" not in verifier        # the final hidden state, as for EAGLE-1/2
    served = build_parser().parse_args(["drafter", "serve", *drafter])
    assert served.medusa == str(heads / "good") and served.medusa_choices == choices
