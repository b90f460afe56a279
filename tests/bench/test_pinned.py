"""``specdec bench --grpc --pin``: verifier and drafter processes on a core
each, in-process methods on the verifier's core; ``--compare-unary`` adds the
unary-steps orchestrator; the per-cycle time split."""

import json
import os

import pytest

from specdec.bench.runner import PinnedMethod, Prompt, Sample, Slot, Totals, summarize
from specdec.cli.main import main
from specdec.procs import pinned_cores

from test_bench import model_flags, prompt_file  # noqa: F401  (fixture)

TWO_CORES = len(os.sched_getaffinity(0)) >= 2


class WhereItRan:
    def __init__(self):
        self.cores = None

    def run(self, prompt, seed):
        self.cores = os.sched_getaffinity(0)
        return Sample(list(prompt.ids), 0.1)


@pytest.mark.skipif(not TWO_CORES, reason="pinning needs 2 CPUs")
def test_pinned_method_runs_on_its_core_and_restores_the_mask():
    before = os.sched_getaffinity(0)
    inner = WhereItRan()
    core = frozenset([pinned_cores()[0]])
    assert PinnedMethod(inner, core).run(Prompt("x", [1, 2]), None).tokens == [1, 2]
    assert inner.cores == core and os.sched_getaffinity(0) == before


def test_per_cycle_time_split():
    t = Totals()
    t.add(Slot(0, 0, "eagle2"), Sample([1] * 8, 0.5, cycles=4, committed=8, draft_s=0.1, verify_s=0.2,
                                       network_s=0.12))
    t.add(Slot(0, 1, "eagle2"), Sample([1] * 8, 0.5, cycles=6, committed=8, draft_s=0.1, verify_s=0.2,
                                       network_s=0.08))
    ms = summarize({"eagle2": t}, greedy=True)["eagle2"]["time_split"]["per_cycle_ms"]
    assert ms == pytest.approx({"draft": 20.0, "verify": 40.0, "network": 20.0, "other": 20.0, "wall": 100.0})


def test_tau_of_cycles_with_a_tree_drafted_ahead_and_of_the_others():
    t = Totals()
    # 10 cycles committing 40 tokens, 6 of them with a tree drafted ahead that committed 18
    t.add(Slot(0, 0, "eagle2@grpc-ahead4"), Sample([1] * 20, 0.5, cycles=4, committed=20, ahead_hits=2,
                                                  ahead_committed=6))
    t.add(Slot(0, 1, "eagle2@grpc-ahead4"), Sample([1] * 20, 0.5, cycles=6, committed=20, ahead_hits=4,
                                                  ahead_committed=12))
    m = summarize({"eagle2@grpc-ahead4": t}, greedy=True)["eagle2@grpc-ahead4"]
    assert m["ahead_hit_rate"] == pytest.approx(0.6)
    assert (m["ahead_tau_hit"], m["ahead_tau_fresh"]) == pytest.approx((3.0, 5.5))
    assert Totals().ahead_tau() == (None, None)


@pytest.mark.parametrize("extra,needle", [
    (["--pin"], "--pin needs --grpc"),
    (["--compare-unary"], "--compare-unary needs --grpc"),
    (["--grpc", "--pin", "--threads", "2"], "--pin runs one torch thread per process"),
    (["--grpc", "--startup-timeout", "0"], "--startup-timeout must be > 0 seconds"),
])
def test_pin_flags_are_checked(tiny_family, prompt_file, tmp_path, capsys, extra, needle):  # noqa: F811
    args = ["bench", *model_flags(tiny_family), "--prompts", str(prompt_file), "--json", str(tmp_path / "x.json")]
    assert main(args + extra) == 2
    assert needle in capsys.readouterr().err


def test_services_not_ready_within_the_startup_timeout_end_the_run_with_one_line(tiny_family, prompt_file, tmp_path,
                                                                                  capsys):  # noqa: F811
    args = ["bench", *model_flags(tiny_family), "--prompts", str(prompt_file), "--max-new-tokens", "4",
            "--methods", "eagle2", "--grpc", "--startup-timeout", "0.01", "--json", str(tmp_path / "x.json")]
    assert main(args) != 0
    errors = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[bench]")]
    assert len(errors) == 1 and "timed out waiting for" in errors[0], errors


@pytest.mark.skipif(not TWO_CORES, reason="pinning needs 2 CPUs")
def test_pinned_run_with_unary_and_lookahead_is_lossless(tiny_family, prompt_file, tmp_path):  # noqa: F811
    """(slow: process start-up)"""
    out = tmp_path / "p.json"
    args = ["bench", *model_flags(tiny_family), "--prompts", str(prompt_file), "--max-new-tokens", "12",
            "--methods", "eagle2", "--grpc", "--pin", "--compare-unary", "--lookahead", "1", "--quiet",
            "--json", str(out), "--report", str(tmp_path / "rep")]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["pinned"] is True and "1 thread " in result["device"]
    methods = result["methods"]
    assert set(methods) == {"vanilla", "hf-generate", "eagle2", "vanilla@grpc", "eagle2@grpc",
                            "eagle2@grpc-ahead1", "eagle2@grpc-unary"}
    for name, m in methods.items():
        assert m["matches_vanilla"] is True, name
    assert 0.0 <= methods["eagle2@grpc-ahead1"]["ahead_hit_rate"] <= 1.0
    assert {"ahead_tau_hit", "ahead_tau_fresh"} <= set(methods["eagle2@grpc-ahead1"])
    assert methods["eagle2@grpc-unary"]["time_split"]["per_cycle_ms"]["network"] > 0
    assert "Time per cycle (ms)" in (tmp_path / "rep" / "results.md").read_text()


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_the_bench_drafter_service_drafts_an_eagle_head_in_float32_under_a_bf16_target(tiny_family, kind):
    """As in process (and under `specdec up`): the services' comparison runs the same head."""
    from specdec.bench.runner import BenchConfig
    from specdec.bench.services import drafter_argv
    from specdec.cli.main import build_parser

    cfg = BenchConfig(target=str(tiny_family["target"]), eagle=str(tiny_family["eagle"]),
                      eagle3=str(tiny_family["eagle"]), dtype="bfloat16", compile="on")
    args = build_parser().parse_args(["drafter", "serve", *drafter_argv(cfg, kind)])
    assert args.dtype == "float32" and args.compile == "on"
