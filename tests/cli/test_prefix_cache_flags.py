"""``--prefix-cache-tokens`` / ``--prefix-cache-exact``: parsed on every command
that runs an engine, checked, and passed by ``up`` to both services."""

import pytest

from specdec.cli.main import build_parser
from specdec.cli.up import _model_argv
from specdec.model.prefix_cache import DEFAULT_TOKENS


@pytest.mark.parametrize("argv", [["verifier", "serve"], ["drafter", "serve"], ["up"], ["generate", "x"],
                                  ["bench", "prefix", "--json", "x.json"]])
def test_every_engine_command_takes_the_flags(argv):
    args = build_parser().parse_args([*argv, "--prefix-cache-tokens", "128", "--prefix-cache-exact"])
    assert (args.prefix_cache_tokens, args.prefix_cache_exact) == (128, True)


def test_the_default_and_a_bad_value(capsys):
    assert build_parser().parse_args(["verifier", "serve"]).prefix_cache_tokens == DEFAULT_TOKENS
    with pytest.raises(SystemExit):
        build_parser().parse_args(["verifier", "serve", "--prefix-cache-tokens", "-1"])
    assert "--prefix-cache-tokens" in capsys.readouterr().err


def test_up_passes_them_to_both_services(tiny_family):
    args = build_parser().parse_args(["up", "--target", str(tiny_family["target"]), "--eagle",
                                      str(tiny_family["eagle"]), "--prefix-cache-tokens", "0"])
    verifier, drafter, _ = _model_argv(args)
    for argv in (verifier, drafter):
        assert argv[argv.index("--prefix-cache-tokens") + 1] == "0" and "--prefix-cache-exact" not in argv
