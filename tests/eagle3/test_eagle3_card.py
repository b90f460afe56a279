"""The model card with an EAGLE-3 head beside the EAGLE-2 one: both heads'
held-out tau at the same trees, the EAGLE-3 head's per-step agreement from its
training log, and a calibration table and plot for each."""

import json
import shutil

from specdec.cli.main import main


def test_card_measures_both_heads_side_by_side(family3, tmp_path, monkeypatch):
    import specdec.train.card as card

    for name in ("target", "eagle", "eagle3"):
        shutil.copytree(family3[name], tmp_path / name)
    evals = {"step": 3, "heldout_in_draft": 0.5} | {f"heldout_top1_{k}": 0.25 + 0.125 * k for k in range(3)}
    (tmp_path / "eagle3" / "training_log.json").write_text(json.dumps(
        {"config": {"steps": 3, "batch": 2, "seq_len": 16}, "evals": [evals], "train_seconds": 1.0}))
    monkeypatch.setattr(card, "heldout_prompts", lambda tok, n: [[5, 6, 7, 8], [9, 10, 11, 12]])
    assert main(["train", "card", "--demo", str(tmp_path), "--max-new-tokens", "8"]) == 0
    text = (tmp_path / "MODEL_CARD.md").read_text()
    data = json.loads((tmp_path / "card.json").read_text())
    for key in ("heldout", "heldout_eagle3"):
        assert set(data[key]["tau"]) == {card.tree_name(t) for t in card.TREES}
        assert all(tau >= 1.0 for tau in data[key]["tau"].values())
        assert sum(b["nodes"] for b in data[key]["calibration"]) > 0
    assert "| tree | tau eagle2 | tau eagle3 |" in text
    assert "specdec train eagle --version 3 --steps 3" in text
    assert "0: 0.250, 1: 0.375, 2: 0.500" in text
    assert text.count("| confidence | nodes | accepted | rate |") == 2
    for plot in ("calibration.png", "calibration-eagle3.png"):
        assert f"({plot})" in text
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
