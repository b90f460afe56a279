"""``specdec bench profile``: the step profile's record and, with compiled
forwards, the side-by-side end-to-end run whose outputs must match vanilla,
batched verification and prefill on each path (``--batches``, ``--prefill``)."""

from __future__ import annotations

import json

import pytest

from specdec.cli.main import main

STEPS = ("target_step", "target_verify16", "eagle_level8")


def _flags(family):
    return ["--target", str(family["target"]), "--eagle", str(family["eagle"]), "--threads", "1"]


def test_eager_profile_record(tiny_family, tmp_path, capsys):
    out = tmp_path / "prof.json"
    assert main(["bench", "profile", *_flags(tiny_family), "--steps", "3", "--prefix", "16",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["prefix"] == 16 and result["compile"] == "off"
    assert set(result["steps"]) == {"eager"}
    for name in STEPS:
        s = result["steps"]["eager"][name]
        assert s["wall_ms"] > 0 and s["aten_ops"] > 10 and 0.0 <= s["dispatch_share"] <= 1.0
        assert 0 <= s["kernel_ms"] <= s["profiled_ms"] * 1.05
    # a one-token step of a 2-layer target dispatches more operators than its head's one layer
    assert result["steps"]["eager"]["target_step"]["aten_ops"] > result["steps"]["eager"]["eagle_level8"]["aten_ops"]
    assert "| eager | target_step |" in capsys.readouterr().out


@pytest.mark.slow
def test_compiled_side_by_side(tiny_family, tmp_path):
    out = tmp_path / "prof.json"
    assert main(["bench", "profile", *_flags(tiny_family), "--steps", "3", "--prefix", "16", "--compile", "on",
                 "--e2e-prompts", "2", "--max-new-tokens", "12", "--total-tokens", "8", "--depth", "3",
                 "--batches", "2,3", "--prefill", "20,70", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["steps"]["compiled"]) == {"target_step", "target_verify16", "eagle_level8"}
    e2e = result["end_to_end"]
    assert set(e2e) == {"vanilla", "eagle2", "vanilla+compiled", "eagle2+compiled"}
    assert all(m["matches_vanilla"] for m in e2e.values())
    paths = {"eager", "compiled rows", "compiled batched"}
    assert set(result["batched_verify"]) == {"B=2", "B=3"}
    assert all(set(t) == paths and min(t.values()) > 0 for by in result["batched_verify"].values() for t in by.values())
    assert set(result["prefill"]) == {"20 tokens", "70 tokens"}


@pytest.mark.parametrize("flags, why", [(["--batches", "2"], "add --compile on"),
                                         (["--compile", "on", "--prefill", "0"], "positive integers")])
def test_batches_and_prefill_flags_are_checked(tiny_family, tmp_path, capsys, flags, why):
    assert main(["bench", "profile", *_flags(tiny_family), *flags, "--json", str(tmp_path / "p.json")]) == 2
    assert why in capsys.readouterr().err


def test_startup_only_times_the_target_and_the_drafter(tiny_family, tmp_path, capsys):
    out = tmp_path / "startup.json"
    assert main(["bench", "profile", *_flags(tiny_family), "--startup-only", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["target_s"] > 0 and result["drafter_s"] > 0
    assert result["startup_s"] == pytest.approx(result["target_s"] + result["drafter_s"], abs=2e-3)
    assert "EAGLE drafter" in capsys.readouterr().out
