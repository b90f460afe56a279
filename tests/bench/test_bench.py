"""``specdec bench``: schema of the JSON record, losslessness of every greedy
method, the report files, the interleaved schedule and calibration binning."""

import json
import math
from collections import Counter

import pytest
import torch

from specdec.bench.calibration import TreeRecorder, bin_index, calibration_bins, tree_points
from specdec.bench.runner import Sample, Slot, Totals, schedule, summarize
from specdec.cli.bench import BUNDLED_PROMPTS
from specdec.cli.main import main
from specdec.tree.build import DraftTree

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
METHOD_KEYS = {"tokens_per_s", "speedup_vs_vanilla", "speedup_vs_hf_generate", "tau", "accepted_per_position",
               "matches_vanilla", "time_split"}
TREE_METHODS = ("vanilla", "eagle2", "ngram")
PEERS = ("hf-generate", "hf-prompt-lookup", "hf-assisted")


def model_flags(family):
    return ["--target", str(family["target"]), "--eagle", str(family["eagle"]), "--draft-lm", str(family["draft-lm"])]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "class Point:\n    def"]))
    return path


@pytest.fixture(scope="module")
def greedy_run(tiny_family, prompt_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    args = ["bench", *model_flags(tiny_family), "--prompts", str(prompt_file), "--max-new-tokens", "8",
            "--methods", "vanilla,hf-generate,eagle2,ngram,hf-prompt-lookup,hf-assisted", "--quiet",
            "--total-tokens", "8", "--depth", "3", "--json", str(out / "r.json"), "--report", str(out / "report")]
    assert main(args) == 0
    return json.loads((out / "r.json").read_text()), out / "report"


def test_json_schema_exact(greedy_run):
    result, _ = greedy_run
    assert {"device", "target", "temperature", "prompts", "max_new_tokens", "methods"} <= set(result)
    assert isinstance(result["device"], str) and "thread" in result["device"]
    assert result["temperature"] == 0.0 and isinstance(result["temperature"], float)
    assert result["prompts"] == 2 and result["max_new_tokens"] == 8
    assert list(result["methods"]) == ["vanilla", "hf-generate", "hf-assisted", "hf-prompt-lookup", "eagle2", "ngram"]
    for name, m in result["methods"].items():
        assert set(m) == METHOD_KEYS, name
        assert m["tokens_per_s"] > 0
        assert isinstance(m["speedup_vs_vanilla"], float) and isinstance(m["speedup_vs_hf_generate"], float)
        assert isinstance(m["accepted_per_position"], list)
        assert all(0.0 <= r <= 1.0 for r in m["accepted_per_position"])
        assert {"draft_s", "verify_s", "network_s", "other_s", "wall_s"} <= set(m["time_split"])
    assert result["generated_tokens"]["vanilla"] == 16        # 2 prompts x 8 tokens (no EOS at these seeds)


def test_figures_are_consistent(greedy_run):
    methods = greedy_run[0]["methods"]
    assert methods["vanilla"]["speedup_vs_vanilla"] == 1.0
    assert methods["hf-generate"]["speedup_vs_hf_generate"] == 1.0
    for name in TREE_METHODS:
        assert methods[name]["tau"] >= 1.0
        split = methods[name]["time_split"]
        fractions = sum(split[f"{k}_frac"] for k in ("draft", "verify", "network", "other"))
        assert math.isclose(fractions, 1.0, abs_tol=2e-3), (name, split)
    assert methods["vanilla"]["tau"] == 1.0 and methods["vanilla"]["accepted_per_position"] == []
    for name in PEERS:
        assert methods[name]["tau"] is None and methods[name]["time_split"]["draft_s"] is None
    ratio = methods["eagle2"]["tokens_per_s"] / methods["vanilla"]["tokens_per_s"]
    assert math.isclose(methods["eagle2"]["speedup_vs_vanilla"], ratio, rel_tol=1e-3)


def test_greedy_methods_match_vanilla(greedy_run):
    for name, m in greedy_run[0]["methods"].items():
        assert m["matches_vanilla"] is True, name


def test_report_files(greedy_run):
    result, report = greedy_run
    md = (report / "results.md").read_text()
    assert "| method | speedup vs vanilla |" in md and "| eagle2 |" in md and "bonus token included" in md
    assert "Calibration (eagle2)" in md
    assert result["compile"] == "off" and "compiled forwards: `--compile off`" in md
    for name in ("speedup.png", "acceptance_per_position.png", "calibration.png"):
        assert (report / name).read_bytes()[:8] == PNG_MAGIC, name
    cal = result["calibration"]
    assert cal["method"] == "eagle2" and len(cal["bins"]) == 20
    assert sum(b["nodes"] for b in cal["bins"]) == cal["evaluated_nodes"] > 0


def test_a_graph_built_inside_the_timed_runs_is_a_warning(tiny_family, prompt_file, tmp_path, monkeypatch, capsys):
    """A package built while the methods are timed (a shape first needed there)
    puts a warning in the record's notes and on stderr; a run without one has none."""
    from specdec.bench import suite
    from specdec.compile import aot

    real = suite.measure

    def measure_with_a_build(*args, **kw):
        aot.BUILT[0] += 1                  # what build_package does when a forward needs a new graph
        return real(*args, **kw)

    monkeypatch.setattr(suite, "measure", measure_with_a_build)
    out = tmp_path / "b.json"
    args = ["bench", *model_flags(tiny_family), "--prompts", str(prompt_file), "--limit-prompts", "1",
            "--max-new-tokens", "4", "--methods", "vanilla", "--json", str(out), "--report", str(tmp_path / "r")]
    assert main(args) == 0
    warnings = [n for n in json.loads(out.read_text())["notes"] if n.startswith("WARNING")]
    assert len(warnings) == 1 and "1 compiled graph built inside the timed runs" in warnings[0]
    assert warnings[0] in capsys.readouterr().err
    assert f"- **{warnings[0]}**" in (tmp_path / "r" / "results.md").read_text()


def test_no_build_inside_the_timed_runs_no_warning(greedy_run):
    assert not [n for n in greedy_run[0]["notes"] if n.startswith("WARNING")]


def test_sampling_run_has_no_output_check(tiny_family, prompt_file, tmp_path):
    out = tmp_path / "t1.json"
    args = ["bench", *model_flags(tiny_family), "--prompts", str(prompt_file), "--limit-prompts", "1",
            "--max-new-tokens", "6", "--temperature", "1.0", "--methods", "eagle2,hf-assisted", "--quiet",
            "--total-tokens", "6", "--depth", "2", "--json", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["temperature"] == 1.0 and result["prompts"] == 1
    assert set(result["methods"]) == {"vanilla", "hf-generate", "hf-assisted", "eagle2"}
    assert all(m["matches_vanilla"] is None for m in result["methods"].values())
    assert result["methods"]["eagle2"]["tau"] >= 1.0


def test_sweep(tiny_family, prompt_file, tmp_path):
    out = tmp_path / "sweep.json"
    args = ["bench", "sweep", *model_flags(tiny_family), "--prompts", str(prompt_file), "--limit-prompts", "1",
            "--max-new-tokens", "6", "--sweep-totals", "4,8", "--sweep-depths", "2,3", "--depth", "2",
            "--total-tokens", "8", "--quiet", "--json", str(out), "--report", str(tmp_path / "rep")]
    assert main(args) == 0
    sweep = json.loads(out.read_text())
    assert [p["total_tokens"] for p in sweep["total_tokens"]] == [4, 8]
    assert [p["depth"] for p in sweep["depth"]] == [2, 3]
    assert all(p["depth"] == 2 for p in sweep["total_tokens"]) and all(p["total_tokens"] == 8 for p in sweep["depth"])
    assert all(p["tau"] >= 1.0 and p["tokens_per_s"] > 0 for p in sweep["total_tokens"] + sweep["depth"])
    assert sweep["best"] in sweep["total_tokens"] + sweep["depth"]
    assert (tmp_path / "rep" / "sweep.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("extra,needle", [
    (["--target", "/nonexistent/target"], "target model directory /nonexistent/target has no config.json"),
    (["--methods", "eagle2,typical"], "unknown method 'typical'"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompts", "/nonexistent.jsonl"], "prompt file not found"),
])
def test_bad_input_is_one_line(tiny_family, prompt_file, tmp_path, capsys, extra, needle):
    args = ["bench", *model_flags(tiny_family), "--prompts", str(prompt_file), "--json", str(tmp_path / "x.json")]
    assert main(args + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specdec: error:") and needle in err[0], err


def test_missing_demo_family_names_the_fix(tmp_path, capsys, monkeypatch):
    import specdec.model.loading

    monkeypatch.setattr(specdec.model.loading, "DEMO_DIR", tmp_path / "no-demo")
    assert main(["bench", "--json", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pass --target or run `specdec train`" in err[0]


def test_bundled_prompts():
    rows = [json.loads(line) for line in BUNDLED_PROMPTS.read_text().splitlines() if line.strip()]
    assert len(rows) >= 20
    assert all(isinstance(r["prompt"], str) and len(r["prompt"]) > 40 for r in rows)
    assert len({r["id"] for r in rows}) == len(rows)


# -- units ----------------------------------------------------------------------------
def test_schedule_rotates_the_order_per_prompt():
    methods = ["a", "b", "c"]
    slots = schedule(methods, n_prompts=6, repeats=2)
    assert len(slots) == 6 * 2 * 3
    per_prompt = [slots[i:i + 3] for i in range(0, len(slots), 3)]
    for block in per_prompt:
        assert sorted(s.method for s in block) == methods              # every method once per prompt
        assert len({(s.repeat, s.prompt) for s in block}) == 1
    orders = [[s.method for s in block] for block in per_prompt]
    assert orders[:4] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    for position in range(3):                                          # each method in each place equally often
        assert Counter(order[position] for order in orders) == {"a": 4, "b": 4, "c": 4}
    assert [(s.repeat, s.prompt) for s in slots[::3]] == [(r, p) for r in range(2) for p in range(6)]


def test_calibration_bins_edges():
    points = [(0.0, False), (0.049, True), (0.05, True), (0.5, False), (0.52, True), (0.999, True), (1.0, True)]
    bins = calibration_bins(points)
    assert len(bins) == 20 and bins[0]["lo"] == 0.0 and bins[-1]["hi"] == 1.0
    assert (bins[0]["nodes"], bins[0]["accepted"], bins[0]["rate"]) == (2, 1, 0.5)
    assert (bins[1]["nodes"], bins[1]["rate"]) == (1, 1.0)
    assert (bins[10]["nodes"], bins[10]["accepted"]) == (2, 1)
    assert (bins[19]["nodes"], bins[19]["rate"]) == (2, 1.0)               # 1.0 lands in the last bin
    assert bins[5]["nodes"] == 0 and bins[5]["rate"] is None
    assert [bin_index(c, 20) for c in (0.0, 0.05, 0.15, 0.95, 1.0)] == [0, 1, 3, 19, 19]


def test_tree_points_count_only_evaluated_nodes():
    # root 0 -> 1 (p .8), 2 (p .1); 1 -> 3 (p .5), 4 (p .25); 2 -> 5 (p .9); 3 -> 6 (p .6)
    parents = [-1, 0, 0, 1, 1, 2, 3]
    local = [1.0, 0.8, 0.1, 0.5, 0.25, 0.9, 0.6]
    values = [0.0] * 7
    for i in range(1, 7):
        values[i] = values[parents[i]] + math.log(local[i])
    points = tree_points(values, parents, accepted=[1, 3])
    # evaluated: children of root (1, 2), of 1 (3, 4), of 3 (6); node 5's parent was rejected
    got = {round(c, 6): ok for c, ok in points}
    assert got == {0.8: True, 0.1: False, 0.5: True, 0.25: False, 0.6: False}


def test_tree_recorder_passes_through_and_records():
    class FakeVerifier:
        target = "model"

        def verify(self, sid, tree):
            return type("R", (), {"accepted": [1]})()

    def tree(parents, local):
        values = [0.0]
        for i in range(1, len(parents)):
            values.append(values[parents[i]] + math.log(local[i]))
        n = len(parents)
        depths = [0] * n
        for i in range(1, n):
            depths[i] = depths[parents[i]] + 1
        return DraftTree(torch.arange(n), torch.tensor(parents), torch.tensor(depths), torch.tensor(values))

    rec = TreeRecorder(FakeVerifier())
    assert rec.target == "model"
    rec.verify("s", tree([-1], [1.0]))                                   # root-only trees are not recorded
    rec.verify("s", tree([-1, 0, 0, 1], [1.0, 0.7, 0.2, 0.4]))
    assert sorted((round(c, 4), ok) for c, ok in rec.points()) == [(0.2, False), (0.4, False), (0.7, True)]
    rec.clear()
    assert rec.points() == []


def test_summarize_rates_speedups_and_matches():
    def totals(samples):
        t = Totals()
        for p, s in enumerate(samples):
            t.add(Slot(0, p, "x"), s)
        return t

    vanilla = totals([Sample([1, 2, 3, 4], 1.0, cycles=3, committed=3, draft_s=0, verify_s=0.9, network_s=0)])
    spec = totals([Sample([1, 2, 3, 4], 0.5, cycles=2, committed=3, accepted_counts=[1], draft_s=0.2,
                          verify_s=0.2, network_s=0)])
    wrong = totals([Sample([1, 2, 3, 5], 0.5)])
    hf = totals([Sample([1, 2, 3, 4], 2.0)])
    out = summarize({"vanilla": vanilla, "hf-generate": hf, "eagle2": spec, "bad": wrong}, greedy=True)
    assert out["eagle2"]["speedup_vs_vanilla"] == 2.0 and out["eagle2"]["speedup_vs_hf_generate"] == 4.0
    assert out["eagle2"]["tau"] == 1.5 and out["eagle2"]["accepted_per_position"] == [0.5]
    assert out["eagle2"]["time_split"]["other_s"] == pytest.approx(0.1)
    assert out["eagle2"]["matches_vanilla"] is True and out["bad"]["matches_vanilla"] is False
    assert out["hf-generate"]["tau"] is None and out["hf-generate"]["time_split"]["other_s"] is None
    sampled = summarize({"vanilla": vanilla, "eagle2": spec}, greedy=False)
    assert sampled["eagle2"]["matches_vanilla"] is None and sampled["eagle2"]["speedup_vs_hf_generate"] is None


@pytest.mark.slow
def test_grpc_methods_match_in_process(tiny_family, prompt_file, tmp_path):
    """--grpc starts and stops the three services per drafter kind (slow: process start-up)."""
    out = tmp_path / "g.json"
    args = ["bench", *model_flags(tiny_family), "--prompts", str(prompt_file), "--max-new-tokens", "8",
            "--methods", "eagle2,ngram", "--grpc", "--quiet", "--json", str(out)]
    assert main(args) == 0
    methods = json.loads(out.read_text())["methods"]
    assert set(methods) == {"vanilla", "hf-generate", "eagle2", "ngram", "vanilla@grpc", "eagle2@grpc", "ngram@grpc"}
    for name in ("vanilla@grpc", "eagle2@grpc", "ngram@grpc"):
        m = methods[name]
        assert m["matches_vanilla"] is True and m["tau"] >= 1.0, name
        assert m["time_split"]["network_s"] > 0


def test_heldout_prompts_are_the_model_cards(tiny_family):
    from specdec.cli.bench import HELDOUT, load_prompts
    from specdec.model.loading import load_tokenizer
    from specdec.train.card import heldout_prompts

    texts = load_prompts(HELDOUT, 3, str(tiny_family["target"]))
    tok = load_tokenizer(tiny_family["target"])
    assert len(texts) == 3 and all(texts)
    assert [tok.decode(ids) for ids in heldout_prompts(tok, 3)] == texts
    bundled = [json.loads(line)["prompt"] for line in BUNDLED_PROMPTS.read_text().splitlines() if line.strip()]
    assert not set(texts) & set(bundled)


def test_tree_sizing_compared_side_by_side(tiny_family, prompt_file, tmp_path):
    args = ["bench", *model_flags(tiny_family), "--prompts", str(prompt_file), "--max-new-tokens", "12",
            "--methods", "vanilla,eagle2", "--quiet", "--total-tokens", "8", "--depth", "3", "--min-tau", "0",
            "--tree-sizing", "cost", "--compare-tree-sizing", "--json", str(tmp_path / "r.json"),
            "--report", str(tmp_path / "report")]
    assert main(args) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert {"eagle2", "eagle2@fixed"} <= set(result["methods"])
    for name in ("eagle2", "eagle2@fixed"):
        assert result["methods"][name]["matches_vanilla"] is True, name
    sizing = result["tree_sizing"]
    assert sizing["mode"] == "cost" and sizing["compared"] is True
    assert {"1", "2", "4", "8"} <= set(sizing["verify_ms"])       # every width the 8-node trees may take, timed
    assert all(ms > 0 for ms in sizing["verify_ms"].values())
    assert "tree sizing: cost" in (tmp_path / "report" / "results.md").read_text()


def test_chat_prompts_run_rendered_with_the_targets_template(tiny_family, tmp_path):
    """{"messages": ...} lines: every method decodes the chat as the target's template renders it."""
    import shutil

    from transformers import AutoTokenizer

    from specdec.model.prompts import prompt_ids

    target = tmp_path / "target"
    shutil.copytree(tiny_family["target"], target)
    (target / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n"
                                                "{% endfor %}<assistant> ")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": c}]})
                               for c in ["def add(a, b):", "import os"]))
    out = tmp_path / "c.json"
    assert main(["bench", "--target", str(target), "--prompts", str(chats), "--max-new-tokens", "8",
                 "--methods", "vanilla,ngram", "--quiet", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["prompts"] == 2 and result["methods"]["ngram"]["matches_vanilla"] is True
    tok = AutoTokenizer.from_pretrained(target)
    rendered = "<user> import os\n<assistant> "
    assert prompt_ids(tok, [{"role": "user", "content": "import os"}]) == tok(rendered, add_special_tokens=False)[
        "input_ids"]
