"""``specdec bench`` methods eagle3 and eagle3@grpc beside eagle2."""

import json

import pytest

from specdec.cli.main import main


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "class Point:\n    def"]))
    return path


def test_eagle3_beside_eagle2_in_process_and_through_grpc(family3, prompt_file, tmp_path):
    """--grpc starts a stack whose drafter serves the EAGLE-3 head (slow: process start-up)."""
    out = tmp_path / "b.json"
    args = ["bench", "--target", str(family3["target"]), "--eagle", str(family3["eagle"]),
            "--eagle3", str(family3["eagle3"]), "--prompts", str(prompt_file), "--max-new-tokens", "8",
            "--methods", "vanilla,eagle2,eagle3", "--grpc", "--quiet", "--json", str(out)]
    assert main(args) == 0
    record = json.loads(out.read_text())
    methods = record["methods"]
    assert {"eagle2", "eagle3", "eagle2@grpc", "eagle3@grpc"} <= set(methods)
    for name in ("eagle3", "eagle3@grpc"):
        assert methods[name]["matches_vanilla"] is True and methods[name]["tau"] >= 1.0, name
    assert methods["eagle3@grpc"]["time_split"]["network_s"] > 0
    assert record["models"]["eagle3"] == str(family3["eagle3"])


def test_eagle3_without_a_head_is_one_line(family3, prompt_file, tmp_path, capsys):
    code = main(["bench", "--target", str(family3["target"]), "--eagle3", str(tmp_path / "none"),
                 "--prompts", str(prompt_file), "--methods", "vanilla,eagle3", "--quiet", "--json", str(tmp_path / "b.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "EAGLE-3 head" in err[0], err
