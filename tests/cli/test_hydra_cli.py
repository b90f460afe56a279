"""``--hydra DIR`` on the command line: ``generate --local`` matches vanilla
with the dynamic and the static tree, for "mlp" and Hydra++ "prefix-mlp"
heads; heads that do not fit (or an unknown ``hydra_head_arch``) are one line
and exit status 2, for ``generate`` and
``drafter serve`` (which refuses to start); ``up`` hands the heads to its
drafter service; ``bench --methods hydra,hydra-static`` matches vanilla."""

import json

import pytest

from specdec.cli.main import main
from tiny import tiny_hydra


@pytest.fixture(scope="module")
def heads(tiny_family, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from drafter.hydra_heads import HydraHeads, save_heads

    root = tmp_path_factory.mktemp("hydra-cli")
    target = AutoModelForCausalLM.from_pretrained(tiny_family["target"])
    save_heads(tiny_hydra(target, seed=5), root / "good")
    save_heads(HydraHeads(24, target.config.vocab_size, 2), root / "narrow")
    save_heads(tiny_hydra(target, seed=5, prefix=True), root / "prefix")
    save_heads(tiny_hydra(target, seed=5), root / "unknown")
    config = json.loads((root / "unknown" / "config.json").read_text())
    (root / "unknown" / "config.json").write_text(json.dumps({**config, "hydra_head_arch": "cross-attn"}))
    return root


def generate(capsys, tiny_family, *flags):
    code = main(["generate", "--local", "--json", "--max-new-tokens", "16", "--target", str(tiny_family["target"]),
                 *flags, "def add(a, b):"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("which", ["good", "prefix"], ids=["mlp", "prefix-mlp"])
@pytest.mark.parametrize("method", ["eagle2", "static"], ids=["hydra", "hydra-static"])
def test_generate_local_matches_vanilla(tiny_family, heads, capsys, method, which):
    code, out, _ = generate(capsys, tiny_family, "--hydra", str(heads / which), "--method", method)
    assert code == 0
    _, ref, _ = generate(capsys, tiny_family, "--method", "vanilla")
    assert json.loads(out)["token_ids"] == json.loads(ref)["token_ids"]


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("which,message", [("narrow", "hidden size 24 does not match the target's 48"),
                                           ("unknown", "hydra_head_arch 'cross-attn' is not supported")])
def test_heads_that_do_not_fit_exit_2_in_one_line(tiny_family, heads, capsys, command, which, message):
    if command == "generate":
        code, _, err = generate(capsys, tiny_family, "--hydra", str(heads / which))
    else:
        code = main(["drafter", "serve", "--hydra", str(heads / which), "--target", str(tiny_family["target"]),
                     "--port", "0"])
        err = capsys.readouterr().err
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1


def test_up_hands_the_heads_to_its_drafter_service(tiny_family, heads):
    from specdec.cli.main import build_parser
    from specdec.cli.up import _model_argv

    args = build_parser().parse_args(["up", "--target", str(tiny_family["target"]), "--hydra", str(heads / "good")])
    verifier, drafter, _ = _model_argv(args)
    assert drafter[:6] == ["--hydra", str(heads / "good"), "--target", str(tiny_family["target"]), "--dtype",
                           "float32"]
    assert "--compile-feature-layers" not in verifier
    served = build_parser().parse_args(["drafter", "serve", *drafter])
    assert served.hydra == str(heads / "good") and served.medusa is None


def test_bench_hydra_methods_match_vanilla(tiny_family, heads, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "class Point:\n    def"]))
    out = tmp_path / "r.json"
    assert main(["bench", "--target", str(tiny_family["target"]), "--hydra", str(heads / "good"),
                 "--prompts", str(prompts), "--max-new-tokens", "8", "--methods", "hydra,hydra-static",
                 "--quiet", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    for name in ("hydra", "hydra-static"):
        assert record["methods"][name]["matches_vanilla"] is True and record["methods"][name]["tau"] >= 1.0, name
    assert record["models"]["hydra"] == str(heads / "good")


def test_hydra_without_a_directory_loads_the_bundled_demo_heads():
    from drafter.hydra import load_hydra_drafter
    from specdec.cli.options import hydra_dir
    from specdec.local import default_paths

    paths = default_paths()
    assert hydra_dir(None) == hydra_dir("") == str(paths["hydra"])
    drafter = load_hydra_drafter(hydra_dir(None), paths["target"])
    assert drafter.num_heads == 4 and drafter.heads.hydra_lm_head[0].weight.dtype.is_floating_point
