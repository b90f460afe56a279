"""`specdec train eagle --chat`: the feature cache (each conversation through the
target once, records equal to the target's own outputs), resume from the
checkpoint with the cache reused, and regeneration inside a training run."""

import json

import pytest
import torch

from chat_tiny import build_chat_target
from specdec.cli.main import main
from specdec.model.loading import ModelSpec, load_causal_lm, load_tokenizer
from specdec.train.chat import chat_tokens
from specdec.train.features import SHARD, FeatureCache, extract
from tiny import CORPUS

TINY = ["--steps", "6", "--batch", "3", "--seq-len", "40", "--eval-every", "3", "--ckpt-every", "2",
        "--no-progress", "--threads", "1"]
VERSIONS = {2: ["--version", "2"], 3: ["--version", "3", "--draft-vocab", "48", "--ttt-steps", "2"]}


def conversations(n):
    snippets = [c.strip() for c in CORPUS[:4]]
    return [[{"role": "user", "content": snippets[i % 4][:20]},
             {"role": "assistant", "content": snippets[(i + 1) % 4]},
             {"role": "user", "content": f"again {i}"},
             {"role": "assistant", "content": snippets[(i + 2) % 4][:30]}] for i in range(n)]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    root = tmp_path_factory.mktemp("chattrain")
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations(12)))
    return {"target": build_chat_target(root, "chatml"), "data": data}


def args(chat, version, workdir, out, *extra):
    return ["train", "eagle", *VERSIONS[version], "--target", str(chat["target"]), "--chat", str(chat["data"]),
            "--workdir", str(workdir), "--out", str(out), *TINY, *extra]


def shard_times(workdir):
    return {p: p.stat().st_mtime_ns for p in sorted(workdir.glob("features-*/shard-*.pt"))}


def test_cached_records_are_the_targets_features_and_extraction_resumes(chat, tmp_path):
    target, tok = load_causal_lm(ModelSpec(str(chat["target"]))), load_tokenizer(chat["target"])
    tokens = [chat_tokens(tok, c) for c in conversations(SHARD + 3)]
    layers, directory = (0, 1), tmp_path / "features-test"
    want = (SHARD, sum(min(len(t.ids), 60) for t in tokens[:SHARD]))
    assert extract(target, tokens[:SHARD], directory, 60, layers, progress=False) == want
    first = shard_times(tmp_path)
    assert len(first) == 1
    # the whole set: the first shard is complete, so only the rest goes through the target
    assert extract(target, tokens, directory, 60, layers, progress=False)[0] == 3
    assert extract(target, tokens, directory, 60, layers, progress=False) == (0, 0)
    assert all(shard_times(tmp_path)[p] == t for p, t in first.items()) and len(shard_times(tmp_path)) == 2
    cache = FeatureCache(directory)
    assert len(cache) == SHARD + 3
    for k in (0, SHARD + 2):
        ids = tokens[k].ids[:60]
        with torch.no_grad():
            out = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
        r = cache.record(k)
        assert r["tokens"].tolist() == ids
        assert r["mask"].tolist() == tokens[k].loss_mask()[:len(ids)].tolist()[:-1] + [False]
        torch.testing.assert_close(r["final"].float(), out.hidden_states[-1][0], rtol=2e-2, atol=2e-2)
        want = torch.cat([out.hidden_states[i][0] for i in layers], -1)
        torch.testing.assert_close(r["layers"].float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("version", [2, 3])
def test_a_stopped_chat_run_resumes_with_its_feature_cache(chat, tmp_path, version):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(args(chat, version, a, tmp_path / "a_out", "--stop-after", "3")) == 0
    assert not (tmp_path / "a_out").exists()
    log = json.loads((a / "log.json").read_text())
    assert len(log["history"]) == 3 and log["features_this_run"]["conversations"] == 12
    times = shard_times(a)
    assert len(times) == 2                                       # train and held-out caches
    assert main(args(chat, version, a, tmp_path / "a_out")) == 0
    log = json.loads((a / "log.json").read_text())
    assert log["finished"] and log["features_this_run"]["conversations"] == 0 and shard_times(a) == times
    assert main(args(chat, version, b, tmp_path / "b_out")) == 0          # the same run, uninterrupted
    assert log["history"] == json.loads((b / "log.json").read_text())["history"]
    assert (tmp_path / "a_out" / "calibration.json").is_file()
    summary = json.loads((tmp_path / "a_out" / "training_log.json").read_text())
    assert summary["chat_train"] + summary["chat_heldout"] == 12 and "top1" in " ".join(log["evals"][-1])


def test_only_assistant_positions_move_the_loss(chat):
    """Changing the features of a position whose next token is not the assistant's
    leaves the EAGLE-2 loss unchanged; at a counted position it changes it."""
    from drafter.eagle.eagle2_head import TargetHead
    from specdec.train.eagle import EagleLoss, feature_losses, head_from_target

    target, tok = load_causal_lm(ModelSpec(str(chat["target"]))), load_tokenizer(chat["target"])
    ct = chat_tokens(tok, conversations(1)[0])
    ids = torch.tensor([ct.ids])
    with torch.no_grad():
        feats = target(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    mask = ct.loss_mask()[None]
    head, io, cfg = head_from_target(target), TargetHead.of_model(target), EagleLoss(noise=0.0)
    base = float(feature_losses(head, io, ids, feats, cfg, mask=mask)[0].detach())
    off = int((~mask[0, 2:]).nonzero()[-1]) + 2          # not counted, a target of the head (>= 1)
    on = int(mask[0].nonzero()[0])
    for pos, same in ((off, True), (on, False)):
        moved = feats.clone()
        moved[0, pos] += 1.0
        loss = float(feature_losses(head, io, ids, moved, cfg, mask=mask)[0].detach())
        assert (loss == pytest.approx(base, abs=1e-6)) == same


def test_regenerate_inside_a_training_run(chat, tmp_path):
    data = tmp_path / "users.jsonl"
    data.write_text("".join(json.dumps({"messages": c[:1]}) + "\n" for c in conversations(6)))
    run = ["train", "eagle", "--version", "2", "--target", str(chat["target"]), "--chat", str(data),
           "--regenerate", "--regen-max-new-tokens", "8", "--regen-batch", "4", "--workdir", str(tmp_path / "w"),
           "--out", str(tmp_path / "o"), *TINY]
    assert main(run) == 0
    written = [json.loads(line)["messages"] for f in ("regenerated-train.jsonl", "regenerated-heldout.jsonl")
               for line in (tmp_path / "w" / f).read_text().splitlines()]
    assert len(written) == 6 and all([m["role"] for m in c] == ["user", "assistant"] for c in written)
