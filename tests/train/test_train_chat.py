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


def test_an_eagle3_chat_batch_takes_the_targets_logits_where_it_trains(chat):
    """``ttt_batch`` asks the target's output head only at the assistant
    positions: there its draft-vocabulary logits and in-draft flags are those of
    the whole batch's logits, elsewhere nothing counts."""
    from drafter.eagle.eagle2_head import TargetHead
    from specdec.train.chat_heads import ttt_batch

    target, tok = load_causal_lm(ModelSpec(str(chat["target"]))), load_tokenizer(chat["target"])
    cts = [chat_tokens(tok, c) for c in conversations(2)]
    width = min(len(c.ids) for c in cts)
    ids = torch.tensor([c.ids[:width] for c in cts])
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    mask = torch.stack([c.loss_mask()[:width] for c in cts])
    t2d = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    t2d[::3] = True
    io = TargetHead.of_model(target)
    b = {"tokens": ids, "final": out.hidden_states[-1], "layers": out.hidden_states[-1].repeat(1, 1, 3),
         "mask": mask}
    got = ttt_batch(io, b, t2d)
    weight = mask[:, 1:]
    assert 0 < int(weight.sum()) < weight.numel() and torch.equal(got.weight, weight)
    with torch.no_grad():
        full = io.logits(b["final"][:, 1:])
    torch.testing.assert_close(got.target[weight], full[..., t2d][weight], rtol=1e-5, atol=1e-5)
    assert torch.equal(got.in_draft[weight], t2d[full.argmax(-1)][weight])
    assert not got.counted()[~weight].any() and not got.target[~weight].any()


def test_several_chat_files_are_one_dataset_without_the_held_out_ones(chat, tmp_path):
    """Two --chat files that share conversations, one of them also held out:
    each trains once, the held-out one not at all."""
    convs = conversations(8)
    files = {"a": convs[:5], "b": convs[3:8], "held": [convs[1], convs[7]]}
    for name, part in files.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in part))
    workdir = tmp_path / "w"
    run = ["train", "eagle", *VERSIONS[2], "--target", str(chat["target"]), "--chat", str(tmp_path / "a.jsonl"),
           str(tmp_path / "b.jsonl"), "--heldout-chat", str(tmp_path / "held.jsonl"), "--workdir", str(workdir),
           "--out", str(tmp_path / "o"), *TINY]
    assert main(run) == 0
    log = json.loads((tmp_path / "o" / "training_log.json").read_text())
    assert (log["chat_train"], log["chat_heldout"]) == (6, 2)         # 8 distinct, 2 of them held out


def test_regenerate_inside_a_training_run(chat, tmp_path):
    data = tmp_path / "users.jsonl"
    users = [[{"role": "user", "content": f"{c[0]['content']} {i}"}] for i, c in enumerate(conversations(6))]
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in users))
    run = ["train", "eagle", "--version", "2", "--target", str(chat["target"]), "--chat", str(data),
           "--regenerate", "--regen-max-new-tokens", "8", "--regen-batch", "4", "--workdir", str(tmp_path / "w"),
           "--out", str(tmp_path / "o"), *TINY]
    assert main(run) == 0
    written = [json.loads(line)["messages"] for f in ("regenerated-train.jsonl", "regenerated-heldout.jsonl")
               for line in (tmp_path / "w" / f).read_text().splitlines()]
    assert len(written) == 6 and all([m["role"] for m in c] == ["user", "assistant"] for c in written)


def test_bf16_precision_keeps_its_own_feature_cache_and_trains(chat, tmp_path):
    """``--precision bf16``: the features come from a bf16-autocast forward into a
    cache of their own (not mixed with fp32 records), close to the fp32 ones;
    the head still trains to finite losses."""
    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    assert main(args(chat, 3, fp32, tmp_path / "o32", "--steps", "2")) == 0
    assert main(args(chat, 3, bf16, tmp_path / "o16", "--steps", "2", "--precision", "bf16")) == 0
    names = {d.name for w in (fp32, bf16) for d in w.glob("features-*")}
    assert len(names) == 4                                     # train and held-out, per precision
    caches = [max((FeatureCache(d) for d in w.glob("features-*")), key=len) for w in (fp32, bf16)]  # the train sets
    a, b = caches[0].record(0), caches[1].record(0)
    assert torch.equal(a["tokens"], b["tokens"]) and not torch.equal(a["layers"], b["layers"])
    torch.testing.assert_close(b["layers"].float(), a["layers"].float(), rtol=0.1, atol=0.1)
    summary = json.loads((tmp_path / "o16" / "training_log.json").read_text())
    assert summary["precision"] == "bf16"
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in summary["history_tail"])
    with pytest.raises(SystemExit):
        main(args(chat, 3, bf16, tmp_path / "o16", "--precision", "fp16"))
    text_run = ["train", "eagle", "--version", "3", "--target", str(chat["target"]), "--out", str(tmp_path / "t"),
                "--workdir", str(tmp_path / "tw"), "--precision", "bf16", *TINY]
    assert main(text_run) == 2 and not (tmp_path / "tw").exists()          # text data: fp32 only


def test_chat_card_measures_a_trained_head_on_held_out_chats(chat, tmp_path):
    """`specdec train chat-card`: the head trained from chats, measured on
    held-out prompts, greedy identical to plain decoding at every budget."""
    head = tmp_path / "card" / "eagle3"
    assert main(args(chat, 3, tmp_path / "w", head)) == 0
    prompts = tmp_path / "held.jsonl"
    prompts.write_text("".join(json.dumps({"messages": c[:3]}) + "\n" for c in conversations(3)))
    assert main(["train", "chat-card", "--target", str(chat["target"]), "--eagle", str(head), "--prompts",
                 str(prompts), "--n", "2", "--max-new-tokens", "10", "--threads", "1"]) == 0
    card = json.loads((tmp_path / "card" / "card.json").read_text())
    runs = card["heldout"]["trees"]
    assert card["heldout"]["prompts"] == 2 and len(runs) == 3
    assert all(r["identical"] == 2 and r["tau"] >= 1.0 for r in runs.values())
    assert card["training"]["chat_train"] + card["training"]["chat_heldout"] == 12
    page = (tmp_path / "card" / "MODEL_CARD.md").read_text()
    assert "| total_tokens=16,depth=6,expand_k=4 |" in page and (tmp_path / "card" / "calibration.png").is_file()


def test_chat_card_refuses_a_prompt_file_without_a_user_turn(chat, tmp_path):
    prompts = tmp_path / "none.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "system", "content": "hi"}]}) + "\n")
    head = tmp_path / "h"
    assert main(args(chat, 3, tmp_path / "w", head, "--steps", "1")) == 0
    assert main(["train", "chat-card", "--target", str(chat["target"]), "--eagle", str(head), "--prompts",
                 str(prompts)]) == 2
