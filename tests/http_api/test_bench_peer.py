"""``specdec bench --openai-url``: the bench drives an OpenAI-compatible server (here specdec's own)."""

from __future__ import annotations

import json

from specdec.bench.openai_peer import OpenAIPeer
from specdec.bench.runner import Prompt
from specdec.cli.main import main
from specdec.client import SpecdecClient

PROMPTS = ["def add(a, b):", "class Point:\n    def"]


def test_peer_tokens_and_stats_are_the_servers(api):
    peer = OpenAIPeer(api.url("eagle"), max_new_tokens=12, temperature=0.0)
    try:
        assert peer.model == api.model
        with SpecdecClient(api.stack.address("eagle"), timeout=60) as sdk:
            for text in PROMPTS:
                sample = peer.run(Prompt(text, []), seed=None)
                want = sdk.complete(text, max_new_tokens=12)
                assert sample.tokens == want.token_ids and sample.wall_s > 0
                assert sample.cycles == want.stats.cycles
                assert sample.accepted_counts == list(want.stats.accepted_per_position)
        seeded = OpenAIPeer(api.url("eagle"), max_new_tokens=12, temperature=1.0, model=api.model)
        with SpecdecClient(api.stack.address("eagle"), timeout=60) as sdk:
            want = sdk.complete(PROMPTS[0], max_new_tokens=12, temperature=1.0, seed=9)
        assert seeded.run(Prompt(PROMPTS[0], []), seed=9).tokens == want.token_ids
        seeded.close()
    finally:
        peer.close()


def test_bench_reports_the_server_as_a_method(api, tiny_family, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS))
    out = tmp_path / "r.json"
    args = ["bench", "--target", str(tiny_family["target"]), "--prompts", str(prompts), "--max-new-tokens", "8",
            "--methods", "vanilla", "--quiet", "--json", str(out), "--openai-url", api.url("eagle")]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["openai_url"] == api.url("eagle")
    m = result["methods"]["openai"]
    assert m["tokens_per_s"] > 0 and m["matches_vanilla"] is True and m["tau"] >= 1.0
    assert result["generated_tokens"]["openai"] == result["generated_tokens"]["vanilla"]


def test_an_unreachable_server_is_one_line(tiny_family, tmp_path, capsys):
    args = ["bench", "--target", str(tiny_family["target"]), "--max-new-tokens", "4", "--limit-prompts", "1",
            "--methods", "vanilla", "--quiet", "--json", str(tmp_path / "r.json"),
            "--openai-url", "http://127.0.0.1:1/v1"]
    assert main(args) == 2
    assert "--openai-url http://127.0.0.1:1/v1" in capsys.readouterr().err
