"""``specdec bench --methods medusa,medusa-static``: in process and through
the services (``--grpc`` starts a drafter service hosting the heads), every
greedy output equals vanilla's."""

import json

from specdec.cli.main import main
from tiny import tiny_medusa


def test_medusa_methods_match_vanilla_in_process_and_through_the_services(tiny_family, tmp_path):
    from transformers import AutoModelForCausalLM

    from drafter.medusa_heads import save_heads

    save_heads(tiny_medusa(AutoModelForCausalLM.from_pretrained(tiny_family["target"]), seed=6), tmp_path / "heads")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "class Point:\n    def"]))
    out = tmp_path / "r.json"
    assert main(["bench", "--target", str(tiny_family["target"]), "--medusa", str(tmp_path / "heads"),
                 "--prompts", str(prompts), "--max-new-tokens", "8", "--methods", "medusa,medusa-static",
                 "--grpc", "--quiet", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    methods = record["methods"]
    assert set(methods) == {"vanilla", "hf-generate", "medusa", "medusa-static", "vanilla@grpc", "medusa@grpc",
                            "medusa-static@grpc"}
    for name in ("medusa", "medusa-static", "medusa@grpc", "medusa-static@grpc"):
        assert methods[name]["matches_vanilla"] is True and methods[name]["tau"] >= 1.0, name
    assert record["models"]["medusa"] == str(tmp_path / "heads")
