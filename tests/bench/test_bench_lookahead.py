"""``specdec bench --methods lookahead``: in process and through the services
(``--grpc`` starts a verifier and an orchestrator, no drafter: the verifier
drafts), every greedy output equals vanilla's; the run records W, N, G."""

import json

import pytest

from specdec.cli.main import main


def test_lookahead_matches_vanilla_in_process_and_through_the_services(tiny_family, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "class Point:\n    def"]))
    out = tmp_path / "r.json"
    assert main(["bench", "--target", str(tiny_family["target"]), "--prompts", str(prompts),
                 "--max-new-tokens", "16", "--methods", "lookahead", "--lookahead-wng", "3,3,2", "--min-tau", "0",
                 "--grpc", "--quiet", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    methods = record["methods"]
    assert set(methods) == {"vanilla", "hf-generate", "lookahead", "vanilla@grpc", "lookahead@grpc"}
    for name in ("lookahead", "lookahead@grpc"):
        assert methods[name]["matches_vanilla"] is True and methods[name]["tau"] >= 1.0, name
    assert methods["lookahead"]["tau"] == methods["lookahead@grpc"]["tau"]
    assert record["lookahead_wng"] == "3,3,2"


def test_a_bad_lookahead_wng_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--methods", "lookahead", "--lookahead-wng", "4,3", "--json", str(tmp_path / "r.json")])
    assert exc.value.code == 2
    assert "--lookahead-wng: must be W,N,G" in capsys.readouterr().err
