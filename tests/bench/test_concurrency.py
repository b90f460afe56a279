"""``specdec bench --concurrency``: the JSON record of a small run through the
services, losslessness under batching, the report, and the figures' units."""

import json

import pytest

from specdec.bench.concurrency import ConcurrencyPlan, Finished, Pool, concurrency_methods, percentile, summarize
from specdec.cli.main import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LEVEL_KEYS = {"aggregate_tokens_per_s", "requests", "tokens", "wall_s", "latency_s", "ttft_s", "tau",
              "speedup_vs_vanilla", "scaling", "matches_vanilla"}


@pytest.fixture(scope="module")
def concurrency_run(tiny_family, tmp_path_factory):
    """C in {1, 2}, 3 requests per level over 2 prompts: one stack (verifier, drafter, orchestrator)."""
    tmp = tmp_path_factory.mktemp("conc")
    prompts = tmp / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "class Point:\n    def"]))
    out = tmp / "c.json"
    args = ["bench", "--target", str(tiny_family["target"]), "--eagle", str(tiny_family["eagle"]),
            "--prompts", str(prompts), "--concurrency", "2,1", "--requests-per-level", "3",
            "--max-new-tokens", "8", "--total-tokens", "8", "--depth", "3", "--threads", "1", "--quiet",
            "--json", str(out), "--report", str(tmp / "report")]
    assert main(args) == 0
    return json.loads(out.read_text()), tmp / "report"


def test_json_schema(concurrency_run):
    result, _ = concurrency_run
    assert result["levels"] == [1, 2] and result["requests_per_level"] == 3 and result["prompts"] == 2
    assert set(result["concurrency"]) == {"vanilla", "eagle2"}
    for name, levels in result["concurrency"].items():
        assert set(levels) == {"1", "2"}, name
        for c, m in levels.items():
            assert set(m) == LEVEL_KEYS, (name, c)
            assert m["requests"] == 3 and m["tokens"] == 3 * 8          # no EOS at these seeds
            assert m["aggregate_tokens_per_s"] > 0 and m["wall_s"] > 0
            assert set(m["latency_s"]) == {"p50", "p90", "p99", "mean"} and set(m["ttft_s"]) == {"p50", "p90"}
    assert set(result["speedup_vs_vanilla"]) == {"eagle2"}
    assert set(result["speedup_vs_vanilla"]["eagle2"]) == {"1", "2"}


def test_batched_outputs_match_vanilla(concurrency_run):
    for name, levels in concurrency_run[0]["concurrency"].items():
        for c, m in levels.items():
            assert m["matches_vanilla"] is True, (name, c)


def test_figures_are_consistent(concurrency_run):
    conc = concurrency_run[0]["concurrency"]
    for name, levels in conc.items():
        assert levels["1"]["scaling"] == 1.0
        for c, m in levels.items():
            lat, ttft = m["latency_s"], m["ttft_s"]
            assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"], (name, c, lat)
            assert 0 < ttft["p50"] <= ttft["p90"] <= lat["p99"], (name, c, ttft)
            assert m["tau"] >= 1.0
    assert all(m["tau"] == 1.0 and m["speedup_vs_vanilla"] == 1.0 for m in conc["vanilla"].values())
    for c, m in conc["eagle2"].items():
        ratio = m["aggregate_tokens_per_s"] / conc["vanilla"][c]["aggregate_tokens_per_s"]
        assert m["speedup_vs_vanilla"] == pytest.approx(ratio, rel=1e-3)
        assert concurrency_run[0]["speedup_vs_vanilla"]["eagle2"][c] == m["speedup_vs_vanilla"]


def test_report_files(concurrency_run):
    _, report = concurrency_run
    md = (report / "results.md").read_text()
    assert "| C | method | aggregate tokens/s |" in md and "| 2 | eagle2 |" in md and "concurrency.png" in md
    assert (report / "concurrency.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("extra,needle", [
    (["--concurrency", "1,0"], "concurrency levels must be >= 1"),
    (["--concurrency", "4", "--requests-per-level", "2"], "must be >= the largest concurrency"),
    (["--concurrency", "1", "--methods", "eagle2,hf-generate"], "'hf-generate' does not run through the services"),
    (["--concurrency", "1", "--methods", "vanilla"], "needs a speculative method"),
    (["sweep", "--concurrency", "1"], "does not combine with `bench sweep`"),
])
def test_bad_input_is_one_line(tiny_family, tmp_path, capsys, extra, needle):
    args = ["bench", "--target", str(tiny_family["target"]), "--eagle", str(tiny_family["eagle"]),
            "--json", str(tmp_path / "x.json"), *extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specdec: error:") and needle in err[0], err


# -- units ----------------------------------------------------------------------------
def test_percentile_interpolates_and_is_ordered():
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    values = [0.3, 0.1, 0.9, 0.5, 0.7, 0.2]
    assert percentile(values, 0) == 0.1 and percentile(values, 100) == 0.9
    qs = [percentile(values, q) for q in (50, 90, 99)]
    assert qs == sorted(qs)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_plan_sorts_levels_and_checks_requests():
    assert ConcurrencyPlan(levels=(8, 1, 2, 2), requests=8).levels == (1, 2, 8)
    with pytest.raises(ValueError, match="largest concurrency"):
        ConcurrencyPlan(levels=(1, 8), requests=4)


def test_methods_put_vanilla_first():
    assert concurrency_methods(["eagle2"]) == ("vanilla", "eagle2")
    assert concurrency_methods(["ngram", "vanilla", "eagle2"]) == ("vanilla", "eagle2", "ngram")


def test_summarize_speedups_scaling_and_matches():
    def pool(outputs, wall, cycles):
        p = Pool()
        p.add([Finished(i % 2, toks, wall / 2, wall / 8, cycles, len(toks)) for i, toks in enumerate(outputs)], wall)
        return p

    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    pools = {"vanilla": {1: pool([a, b], 2.0, 4), 2: pool([a, b], 1.0, 4)},
             "eagle2": {1: pool([a, b], 1.0, 2), 2: pool([a, [5, 6, 7, 9]], 0.25, 2)}}
    conc, speedups = summarize(pools, greedy=True)
    assert conc["vanilla"]["1"]["aggregate_tokens_per_s"] == 4.0 and conc["vanilla"]["2"]["scaling"] == 2.0
    assert conc["eagle2"]["1"]["speedup_vs_vanilla"] == 2.0 and conc["eagle2"]["2"]["speedup_vs_vanilla"] == 4.0
    assert conc["eagle2"]["2"]["scaling"] == 4.0 and conc["eagle2"]["1"]["tau"] == 2.0
    assert speedups == {"eagle2": {"1": 2.0, "2": 4.0}}
    assert conc["eagle2"]["1"]["matches_vanilla"] is True and conc["eagle2"]["2"]["matches_vanilla"] is False
    sampled, _ = summarize(pools, greedy=False)
    assert all(m["matches_vanilla"] is None for levels in sampled.values() for m in levels.values())
