"""``--method lookahead`` on the command line: ``generate --local`` matches
vanilla with W, N, G from ``--lookahead-wng``; a bad W,N,G is one line and
exit status 2; ``up`` starts no drafter and hands W,N,G to its verifier and
the method to its orchestrator; ``verifier serve`` takes the flag."""

import json

import pytest

from specdec.cli.main import build_parser, main


def generate(capsys, tiny_family, *flags):
    code = main(["generate", "--local", "--json", "--max-new-tokens", "24", "--target", str(tiny_family["target"]),
                 *flags, "for i in range(3):\n"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("wng", [None, "2,2,3", "3,4,2"])
def test_generate_local_matches_vanilla(tiny_family, capsys, wng):
    code, out, _ = generate(capsys, tiny_family, "--method", "lookahead", *(["--lookahead-wng", wng] if wng else []))
    assert code == 0
    _, ref, _ = generate(capsys, tiny_family, "--method", "vanilla")
    assert json.loads(out)["token_ids"] == json.loads(ref)["token_ids"]


@pytest.mark.parametrize("wng,why", [("4,3", "must be W,N,G"), ("4,1,4", "lookahead ngram must be an integer >= 2"),
                                     ("15,5,15", "lookahead W,N,G = 15,5,15")])
def test_a_bad_lookahead_wng_is_one_line(tiny_family, capsys, wng, why):
    with pytest.raises(SystemExit) as exc:
        generate(capsys, tiny_family, "--method", "lookahead", "--lookahead-wng", wng)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--lookahead-wng: {why}" in err


def test_up_starts_no_drafter_and_hands_the_parameters_on(tiny_family):
    from specdec.cli.up import _model_argv

    args = build_parser().parse_args(["up", "--target", str(tiny_family["target"]), "--method", "lookahead",
                                      "--lookahead-wng", "5,3,2"])
    verifier, drafter, _ = _model_argv(args)
    assert drafter is None
    served = build_parser().parse_args(["verifier", "serve", *verifier])
    assert (served.lookahead_wng.window, served.lookahead_wng.ngram, served.lookahead_wng.guesses) == (5, 3, 2)
    orchestrator = build_parser().parse_args(["orchestrator", "serve", "--verifier", "x:1", "--method", "lookahead"])
    assert orchestrator.method == "lookahead"
