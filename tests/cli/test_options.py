"""Shared flags of specdec.cli.options: --compile, its variable SPECDEC_COMPILE,
SPECDEC_COMPILE_PACKED, SPECDEC_COMPILE_PACKED_HEADS and SPECDEC_COMPILE_ROW_PRODUCTS (how the compiled graphs hold and multiply the weights),
SPECDEC_COMPILE_AHEAD (which graphs start-up builds) and SPECDEC_CUDA_GRAPHS (compiled steps on a GPU replayed as CUDA graphs), and
--tree-sizing with its variable SPECDEC_TREE_SIZING (specdec.tree.sizing)."""

import pytest

from specdec.cli.main import build_parser, main
from specdec.request import knobs

SERVE = (["verifier", "serve"], ["drafter", "serve"])


@pytest.mark.parametrize("argv", SERVE)
def test_compile_defaults_to_off_without_the_variable(argv, monkeypatch):
    monkeypatch.delenv("SPECDEC_COMPILE", raising=False)
    assert build_parser().parse_args(argv).compile == "off"
    monkeypatch.setenv("SPECDEC_COMPILE", "")          # set but empty: unset
    assert build_parser().parse_args(argv).compile == "off"


@pytest.mark.parametrize("argv", SERVE)
def test_compile_default_comes_from_the_variable_and_the_flag_wins(argv, monkeypatch):
    monkeypatch.setenv("SPECDEC_COMPILE", "AUTO")
    assert build_parser().parse_args(argv).compile == "auto"
    assert build_parser().parse_args([*argv, "--compile", "off"]).compile == "off"
    monkeypatch.setenv("SPECDEC_COMPILE", "bogus")     # never read when the flag is given
    assert build_parser().parse_args([*argv, "--compile", "on"]).compile == "on"


@pytest.mark.parametrize("argv, variable, env, flag, choices", [
    (["verifier", "serve"], "SPECDEC_COMPILE", "bogus", "--compile", "auto, on, off"),
    (["drafter", "serve"], "SPECDEC_COMPILE", "yes", "--compile", "auto, on, off"),
    (["verifier", "serve", "--compile", "fast"], "SPECDEC_COMPILE", None, "--compile", "auto, on, off"),
    (["verifier", "serve"], "SPECDEC_TREE_SIZING", "auto", "--tree-sizing", "cost, fixed"),
    (["verifier", "serve", "--tree-sizing", "fast"], "SPECDEC_TREE_SIZING", None, "--tree-sizing", "cost, fixed")])
def test_a_bad_mode_is_a_usage_error(argv, variable, env, flag, choices, monkeypatch, capsys):
    """From the variable or the flag: exit 2 and one line naming the flag and its choices."""
    if env is None:
        monkeypatch.delenv(variable, raising=False)
    else:
        monkeypatch.setenv(variable, env)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "error" in x]
    assert line.endswith(f"argument {flag}: must be one of {choices}, got {env or 'fast'!r}"), err
    assert "Traceback" not in err


@pytest.mark.parametrize("variable, choices", [("SPECDEC_COMPILE_PACKED", "auto, on, off"),
                                               ("SPECDEC_COMPILE_PACKED_HEADS", "auto, on, off"),
                                               ("SPECDEC_COMPILE_ROW_PRODUCTS", "auto, on, off"),
                                               ("SPECDEC_COMPILE_AHEAD", "all, ready"),
                                               ("SPECDEC_CUDA_GRAPHS", "on, off")])
def test_a_bad_compile_setting_is_a_usage_error(variable, choices, monkeypatch, capsys):
    monkeypatch.setenv(variable, "sometimes")
    with pytest.raises(SystemExit) as exc:
        main(["verifier", "serve", "--compile", "on"])
    assert exc.value.code == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert line.endswith(f"{variable} must be one of {choices}, got 'sometimes'")


SIZED = (["verifier", "serve"], ["up"], ["generate", "x"], ["bench", "--json", "r.json"])


@pytest.mark.parametrize("argv", SIZED)
def test_tree_sizing_defaults_to_fixed_and_comes_from_the_variable(argv, monkeypatch):
    monkeypatch.delenv("SPECDEC_TREE_SIZING", raising=False)
    assert build_parser().parse_args(argv).tree_sizing == "fixed"
    monkeypatch.setenv("SPECDEC_TREE_SIZING", "cost")
    assert build_parser().parse_args(argv).tree_sizing == "cost"
    assert build_parser().parse_args([*argv, "--tree-sizing", "fixed"]).tree_sizing == "fixed"


def test_compile_tree_tokens_defaults_to_the_default_tree_and_comes_from_the_variable(monkeypatch):
    monkeypatch.delenv("SPECDEC_COMPILE_TREE_TOKENS", raising=False)
    assert build_parser().parse_args(["verifier", "serve"]).compile_tree_tokens == knobs.DEFAULT_TOTAL_TOKENS
    monkeypatch.setenv("SPECDEC_COMPILE_TREE_TOKENS", "48")
    assert build_parser().parse_args(["verifier", "serve"]).compile_tree_tokens == 48


@pytest.mark.parametrize("value", ["0", "65"])
def test_compile_tree_tokens_out_of_range_is_one_line(value, capsys):
    assert main(["verifier", "serve", "--compile-tree-tokens", value]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "error" in x]
    assert line.endswith(f"--compile-tree-tokens must be in [1, {knobs.MAX_COMPILED_TREE}], got {value}")
    assert "Traceback" not in err


def test_the_widest_compiled_tree_is_the_widest_graph():
    from specdec.compile.fixed_graphs import WIDTHS

    assert knobs.MAX_COMPILED_TREE == WIDTHS[-1]
