"""`specdec train eagle --version 3`: draft vocabulary, training-time test, resume, the saved head."""

import itertools
import json

import pytest
import torch
from safetensors.torch import load_file

from specdec.cli.main import main
from specdec.train.draft_vocab import choose_draft_vocab, draft_target_ids, token_counts
from specdec.train.eagle3 import (computes_the_same, corpus_draft_vocab, eagle3_losses, new_head, target_batch,
                                  training_feature_layers)
from specdec.train.ttt import shifted, step_weights, ttt_allowed, unrolled_hidden, unrolled_losses
from drafter.base import read_value_temperature
from drafter.eagle.eagle3_head import load_head3
from tiny import CORPUS, build_family

DRAFT_VOCAB = 48
TINY = ["--steps", "12", "--batch", "3", "--seq-len", "24", "--eval-every", "6", "--ckpt-every", "4",
        "--no-progress", "--threads", "1", "--draft-vocab", str(DRAFT_VOCAB), "--ttt-steps", "3"]

REFERENCE_KEYS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                  *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
                  *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
                  *(f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm"))}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("e3family")
    paths = build_family(root)
    data = root / "data"
    data.mkdir()
    for i in range(4):
        (data / f"mod{i}.py").write_text("".join(CORPUS[i::4]))
    paths["data"] = sorted(str(p) for p in data.iterdir())
    return paths


@pytest.fixture(scope="module")
def target(family):
    from specdec.model.loading import ModelSpec, load_causal_lm

    model = load_causal_lm(ModelSpec(str(family["target"])))
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def train_args(family, out, workdir, *extra):
    return ["train", "eagle", "--version", "3", "--target", str(family["target"]), "--data", *family["data"],
            "--out", str(out), "--workdir", str(workdir), *TINY, *extra]


def history(workdir):
    return json.loads((workdir / "log.json").read_text())["history"]


def test_draft_vocab_keeps_the_most_frequent_tokens_and_the_maps_agree():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3, 2, 9])
    vocab = choose_draft_vocab(counts, 4, keep=(6,))
    # 9, 9, 9 (ids 2, 3, 9: ties keep the lower ids first) and the kept id 6
    assert vocab.target_ids.tolist() == [2, 3, 6, 9]
    assert vocab.coverage == pytest.approx(27 / 45)
    assert torch.equal(vocab.target_ids, draft_target_ids(vocab.d2t))
    assert torch.equal(torch.arange(4) + vocab.d2t, vocab.target_ids)
    assert vocab.t2d.tolist() == [i in (2, 3, 6, 9) for i in range(10)]
    assert choose_draft_vocab(counts, 10).t2d.all() and choose_draft_vocab(counts, 10).coverage == 1.0
    with pytest.raises(ValueError):
        choose_draft_vocab(counts, 11)


def test_corpus_draft_vocab_covers_the_commonest_tokens_of_the_stream():
    gen = torch.Generator().manual_seed(0)
    stream = torch.multinomial(torch.softmax(torch.randn(200, generator=gen) * 2, 0), 5000, True, generator=gen)
    vocab = corpus_draft_vocab(stream, 200, 30, eos=199)
    counts = token_counts(stream, 200)
    rest = [i for i in vocab.target_ids.tolist() if i != 199]
    assert 199 in vocab.target_ids.tolist() and len(vocab) == 30
    assert min(counts[rest]) >= max(counts[~vocab.t2d])           # nothing left out is more frequent
    assert vocab.coverage == pytest.approx(float(counts[vocab.target_ids].sum()) / 5000)


@pytest.mark.parametrize("layers, expected", [(32, (2, 16, 29)), (20, (2, 10, 17)), (6, (2, 3, 3)),
                                              (4, (1, 2, 2)), (2, (0, 1, 1))])
def test_feature_layers_are_the_references_clamped_to_the_layer_inputs(layers, expected):
    assert training_feature_layers(layers) == expected


def test_new_head_starts_from_the_targets_output_head_and_norm(target):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    size = target.config.vocab_size
    vocab = corpus_draft_vocab(torch.arange(size), size, DRAFT_VOCAB, 0)
    head = new_head(target, vocab, training_feature_layers(2))
    assert torch.equal(head.lm_head.weight, target.get_output_embeddings().weight[vocab.target_ids])
    assert torch.equal(head.norm.weight, target.get_decoder().norm.weight)
    assert torch.equal(head.embedding, target.get_input_embeddings().weight)
    assert torch.equal(head.to_target_ids(torch.arange(DRAFT_VOCAB)), vocab.target_ids)
    llama, gemma = LlamaRMSNorm(8), GemmaRMSNorm(8)
    with torch.no_grad():
        llama.weight.uniform_(0.5, 1.5)
        gemma.weight.copy_(llama.weight)
    assert computes_the_same(llama, llama, 8) and not computes_the_same(gemma, llama, 8)


def test_ttt_mask_is_causal_context_plus_the_positions_own_chain():
    allowed = ttt_allowed(4, 2)                                   # [4, 12]
    assert torch.equal(allowed[:, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(allowed[:, 4:8], torch.eye(4, dtype=torch.bool))
    assert torch.equal(allowed[:, 8:], torch.eye(4, dtype=torch.bool))


def test_unrolled_steps_equal_drafting_a_chain_over_a_cache(family, target):
    """Step k of training-time test at position t computes exactly what the head
    computes drafting k tokens ahead of t: the context's keys up to t, then its
    own chain, one token at a time at positions t+1.., feeding back its output."""
    from transformers.cache_utils import DynamicCache

    vocab = corpus_draft_vocab(torch.arange(target.config.vocab_size), target.config.vocab_size, DRAFT_VOCAB, 0)
    head = new_head(target, vocab, training_feature_layers(2)).eval()
    windows = torch.randint(1, target.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    batch = target_batch(target, windows, head.layers, head.t2d)
    with torch.no_grad():
        unrolled = list(unrolled_hidden(head, head.embed_tokens, batch, 3))
        for t in (0, 3, 5):
            cache = DynamicCache()
            positions = torch.arange(t + 1)[None].expand(2, -1)
            hidden = head(head.embed_tokens(windows[:, 1:t + 2]), head.project(batch.features[:, :t + 1]),
                          positions, None, cache)[:, -1:]
            torch.testing.assert_close(hidden[:, 0], unrolled[0][:, t], rtol=1e-4, atol=1e-5)
            for k in (1, 2):
                hidden = head(head.embed_tokens(windows[:, t + 1 + k:t + 2 + k]), hidden,
                              torch.full((2, 1), t + k), None, cache)
                torch.testing.assert_close(hidden[:, 0], unrolled[k][:, t], rtol=1e-4, atol=1e-5)


def test_loss_is_the_decayed_sum_of_soft_cross_entropies(family, target):
    vocab = corpus_draft_vocab(torch.arange(target.config.vocab_size), target.config.vocab_size, DRAFT_VOCAB, 0)
    head = new_head(target, vocab, training_feature_layers(2))
    windows = torch.randint(1, target.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(4))
    batch = target_batch(target, windows, head.layers, head.t2d)
    loss, metrics = unrolled_losses(head, head.embed_tokens, batch, 4)
    assert float(loss.detach()) == pytest.approx(sum(w * metrics[f"loss_{k}"] for k, w in enumerate(step_weights(4))),
                                        rel=1e-5)
    assert step_weights(3) == pytest.approx([1.0, 0.8, 0.64])
    # step 0 by hand: -sum p log q over positions whose target argmax is in the draft vocabulary
    logq = torch.log_softmax(head.draft_logits(next(unrolled_hidden(head, head.embed_tokens, batch, 1))), -1)
    p = torch.softmax(target(input_ids=windows).logits[:, 1:, vocab.target_ids], -1)
    by_hand = -((p * logq).sum(-1) * batch.in_draft).mean()
    assert metrics["loss_0"] == pytest.approx(float(by_hand.detach()), rel=1e-4)


def dense_losses(head, batch, steps: int):
    """The loss over every B*S position with the uncounted ones multiplied by 0
    (the training-time test's definition, without gathering the counted rows)."""
    target_p, target_top = torch.softmax(batch.target.float(), -1), batch.target.argmax(-1)
    total, tops = 0.0, []
    for k, hidden in enumerate(unrolled_hidden(head, head.embed_tokens, batch, steps)):
        logp = torch.log_softmax(head.draft_logits(hidden).float(), -1)
        valid = shifted(batch.counted(), k, False)
        total = total + step_weights(steps)[k] * -(valid.float() * (shifted(target_p, k) * logp).sum(-1)).mean()
        tops.append(int(((logp.argmax(-1) == shifted(target_top, k)) & valid).sum()) / max(1, int(valid.sum())))
    return total, tops


def test_only_counted_rows_go_through_the_draft_vocabulary_and_the_loss_is_unchanged(family, target):
    """A batch whose windows count only from some position on (a chat's
    assistant tokens) and not at all in one window: the gathered loss, every
    step's top-1 and the gradients equal the dense definition's."""
    size = target.config.vocab_size
    vocab = corpus_draft_vocab(torch.arange(size), size, size // 2, 0)        # about half the argmaxes count
    head = new_head(target, vocab, training_feature_layers(2))
    windows = torch.randint(1, size, (3, 13), generator=torch.Generator().manual_seed(6))
    dense = target_batch(target, windows, head.layers, head.t2d)
    weight = torch.zeros_like(dense.in_draft)
    weight[0, 4:] = weight[2, 1:9] = True
    batch = type(dense)(dense.features, dense.tokens, dense.target, dense.in_draft, weight)
    assert 0 < int(batch.counted().sum()) < int(weight.sum()) < weight.numel()
    loss, metrics = unrolled_losses(head, head.embed_tokens, batch, 4)
    grads = torch.autograd.grad(loss, list(head.parameters()), allow_unused=True)
    want, tops = dense_losses(head, batch, 4)
    want_grads = torch.autograd.grad(want, list(head.parameters()), allow_unused=True)
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    assert [metrics[f"top1_{k}"] for k in range(4)] == tops
    for g, w in zip(grads, want_grads):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)


def test_loss_falls_on_a_repeated_batch(family, target):
    """The loss approaches its floor, the weighted entropy of the target's
    distributions (a random target's are broad): the KL part halves."""
    torch.manual_seed(0)
    size = target.config.vocab_size                   # every target argmax counts in the loss
    vocab = corpus_draft_vocab(torch.arange(size), size, size, 0)
    head = new_head(target, vocab, training_feature_layers(2))
    windows = torch.randint(1, size, (4, 17), generator=torch.Generator().manual_seed(5))
    batch = target_batch(target, windows, head.layers, head.t2d)
    p = torch.softmax(batch.target, -1)
    entropy = -(p * p.log()).sum(-1)                                             # [B, S]
    floor = sum(w * float((shifted(entropy, k) * shifted(batch.in_draft, k, False)).mean())
                for k, w in enumerate(step_weights(3)))
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss, _ = eagle3_losses(head, target, windows, 3)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(b < a for a, b in itertools.pairwise(losses))
    assert losses[-1] - floor < 0.5 * (losses[0] - floor)


def test_interrupted_run_resumes_to_the_same_head(family, tmp_path):
    assert main([*train_args(family, tmp_path / "a_out", tmp_path / "a"), "--stop-after", "7"]) == 0
    assert len(history(tmp_path / "a")) == 7
    assert not (tmp_path / "a_out").exists()                     # only a finished head is exported
    assert main(train_args(family, tmp_path / "a_out", tmp_path / "a")) == 0
    assert main(train_args(family, tmp_path / "b_out", tmp_path / "b")) == 0
    assert history(tmp_path / "a") == history(tmp_path / "b")
    a, b = load_file(tmp_path / "a_out" / "model.safetensors"), load_file(tmp_path / "b_out" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log = json.loads((tmp_path / "a" / "log.json").read_text())
    assert log["evals"][-1]["step"] == 12 and "heldout_loss_2" in log["evals"][-1]


@pytest.fixture(scope="module")
def trained3(family, tmp_path_factory):
    root = tmp_path_factory.mktemp("e3trained")
    assert main(train_args(family, root / "out", root / "wd")) == 0
    return root


def test_saved_head_has_the_reference_keys_and_loads(trained3):
    tmp_path = trained3
    state = load_file(tmp_path / "out" / "model.safetensors")
    assert set(state) == REFERENCE_KEYS
    head = load_head3(tmp_path / "out", target_layers=2)
    assert head.draft_vocab_size == DRAFT_VOCAB and head.layers == training_feature_layers(2)
    ids = head.to_target_ids(torch.arange(DRAFT_VOCAB))
    assert torch.equal(ids, ids.sort().values) and bool(head.t2d[ids].all())
    assert int(head.t2d.sum()) == DRAFT_VOCAB and 0 in ids.tolist()          # end-of-text is always kept
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["architectures"] == ["LlamaForCausalLMEagle3"]
    calibration = json.loads((tmp_path / "out" / "calibration.json").read_text())
    assert read_value_temperature(tmp_path / "out") == calibration["greedy_value_temperature"]
    assert 0 < calibration["target_argmax_in_draft_vocab"] <= 1
    summary = json.loads((tmp_path / "out" / "training_log.json").read_text())
    assert summary["ttt_steps"] == 3 and summary["draft_vocab"] == DRAFT_VOCAB


def test_calibrate_refits_an_eagle3_head_to_the_same_temperature(family, trained3, capsys):
    written = json.loads((trained3 / "out" / "calibration.json").read_text())
    (trained3 / "out" / "calibration.json").unlink()
    assert main(["train", "calibrate", "--target", str(family["target"]), "--eagle", str(trained3 / "out"),
                 "--data", *family["data"], "--seq-len", "24"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == json.loads((trained3 / "out" / "calibration.json").read_text())
    # the head as saved (fp16) and as trained (fp32), the same held-out windows: the same fit
    assert printed["greedy_value_temperature"] == written["greedy_value_temperature"]
    assert printed["target_argmax_in_draft_vocab"] == written["target_argmax_in_draft_vocab"]


def test_calibration_without_a_single_draftable_position_keeps_temperature_one(family, target, tmp_path):
    from specdec.train.eagle3 import calibrate_head3

    size = target.config.vocab_size
    windows = torch.randint(1, size, (2, 13), generator=torch.Generator().manual_seed(6))
    predicted = set(target(input_ids=windows).logits[:, 1:].argmax(-1).flatten().tolist())
    unused = [i for i in range(size) if i not in predicted][:4]
    head = new_head(target, choose_draft_vocab(torch.zeros(size), 4, keep=tuple(unused)), training_feature_layers(2))
    record = calibrate_head3(head, target, windows.flatten(), tmp_path, seq_len=12, windows=2)
    assert record["greedy_value_temperature"] == 1.0
    assert read_value_temperature(tmp_path) == 1.0


@pytest.mark.parametrize("flags, needle", [(["--version", "3", "--w-reg", "2"], "--w-reg"),
                                           (["--draft-vocab", "10"], "--draft-vocab"),
                                           (["--version", "3", "--ttt-steps", "0"], "--ttt-steps")])
def test_flags_of_the_other_version_are_refused(family, tmp_path, capsys, flags, needle):
    assert main(["train", "eagle", "--target", str(family["target"]), "--data", *family["data"],
                 "--workdir", str(tmp_path), "--out", str(tmp_path / "out"), *flags]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_init_starts_from_a_heads_weights_and_vocabulary_on_other_layers(family, trained3, tmp_path):
    init = load_head3(trained3 / "out", target_layers=2)
    flags = [f for f in TINY if f not in ("--draft-vocab", str(DRAFT_VOCAB))]
    args = ["train", "eagle", "--version", "3", "--target", str(family["target"]), "--data", *family["data"],
            "--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "wd"), *flags, "--lr", "1e-12",
            "--init", str(trained3 / "out"), "--feature-layers", "1,0,1"]
    assert main(args) == 0
    head = load_head3(tmp_path / "out", target_layers=2)
    assert head.layers == (0, 1, 1)                                       # sorted low to high
    assert torch.equal(head.d2t, init.d2t) and torch.equal(head.t2d, init.t2d)
    for name, value in init.state_dict().items():                        # no step moved them (lr ~ 0)
        assert torch.allclose(head.state_dict()[name].float(), value.float(), atol=1e-3), name
    assert json.loads((tmp_path / "out" / "training_log.json").read_text())["init"] == str(trained3 / "out")


@pytest.mark.parametrize("flags, needle", [(["--feature-layers", "1,2"], "three layers"),
                                           (["--feature-layers", "a,b,c"], "three integers"),
                                           (["--feature-layers", "0,1,2"], "0..1"),
                                           (["--init", "x", "--draft-vocab", "8"], "--draft-vocab")])
def test_bad_feature_layers_or_init_flags_exit_with_one_line(family, tmp_path, capsys, flags, needle):
    assert main(["train", "eagle", "--version", "3", "--target", str(family["target"]), "--data", *family["data"],
                 "--workdir", str(tmp_path), "--out", str(tmp_path / "out"), "--steps", "1", "--no-progress",
                 *flags]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
