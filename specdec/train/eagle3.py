"""Train an EAGLE-3 head for any local causal-LM target.

Per window of corpus tokens the frozen target gives its hidden states at
three layers (low, middle, high: ``training_feature_layers``) and its
next-token logits. The head (``drafter.eagle.eagle3_head.Eagle3Head``, the
reference checkpoint layout) fuses the three features with ``fc`` and is
trained with training-time test (``specdec.train.ttt``): unrolled on its own
outputs for ``ttt_steps`` steps, each step's loss the soft cross-entropy to
the target's distribution over the draft vocabulary, weighted 0.8**k
(Li et al., EAGLE-3, arXiv:2503.01840; the EAGLE authors'
``eagle/traineagle3``). The draft vocabulary is the training corpus's most
frequent tokens (``specdec.train.draft_vocab``). The target is read only
through transformers' public API (``output_hidden_states``, input and output
embeddings), so any family trains a head.

Unlike the reference, whose head starts from random weights, the head's
final norm and lm_head start from the target's final norm (when it computes
what a Llama RMSNorm with its weight computes) and the draft vocabulary's rows
of the target's output head, and the MLP from the target's last layer where
the tensors have the same shapes: on a small CPU budget the head starts in
the target's own output space. Nothing else differs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.request.errors import InvalidArgument
from specdec.train.data import eval_windows, frozen_target, sample_batch, tokenize_stream
from specdec.train.draft_vocab import DraftVocab, choose_draft_vocab, token_counts
from specdec.train.eagle import calibration_record, write_calibration
from specdec.train.loop import TrainConfig, train
from specdec.train.ttt import DEFAULT_STEPS, TttBatch, unrolled_losses
from drafter.eagle import eagle3_layouts as layouts
from drafter.eagle.eagle2_head import TargetHead
from drafter.eagle.eagle3_head import Eagle3Head, head3_config, head3_config_for, load_head3, save_head

MAX_DRAFT_VOCAB = 32000      # the reference's draft vocabulary (of Llama-3's 128K)


@dataclass(frozen=True)
class Eagle3Options:
    draft_vocab: int = 0              # 0: default_draft_vocab(V)
    ttt_steps: int = DEFAULT_STEPS
    feature_layers: tuple[int, ...] = ()   # HF hidden-state indices; (): training_feature_layers
    init: str | None = None           # a head directory to start from (its weights and draft vocabulary)


def default_draft_vocab(vocab_size: int) -> int:
    """A quarter of the target's vocabulary, at most the reference's 32000."""
    return max(1, min(MAX_DRAFT_VOCAB, vocab_size // 4))


def training_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """The HF hidden-state indices the head reads (``default_feature_layers``)."""
    return layouts.default_feature_layers(num_layers)


def new_head(target, vocab: DraftVocab, layers: tuple[int, ...]) -> Eagle3Head:
    """A fresh head for ``target`` over the draft vocabulary ``vocab`` (see the
    module doc for which tensors start from the target's)."""
    config = head3_config_for(target.config, draft_vocab_size=len(vocab), layers=layers)
    head = Eagle3Head(head3_config(layouts.llama_fields(config)), layers)
    head.set_draft_vocab(vocab.target_ids)
    io = TargetHead.of_model(target)
    decoder = target.get_decoder()
    with torch.no_grad():
        if io.lm_head.shape[1] == head.config.hidden_size:
            head.lm_head.weight.copy_(io.lm_head[vocab.target_ids])
        norm = getattr(decoder, "norm", None)
        if norm is not None and getattr(norm, "weight", None) is not None \
                and norm.weight.shape == head.norm.weight.shape:
            head.norm.weight.copy_(norm.weight)
            if not computes_the_same(norm, head.norm, head.config.hidden_size):
                head.norm.weight.fill_(1.0)          # another norm (Gemma's 1 + w, a LayerNorm): start plain
        layers_of_target = getattr(decoder, "layers", None)
        if layers_of_target is not None:
            own = head.midlayer.state_dict()
            last = {k: v for k, v in layers_of_target[-1].state_dict().items()
                    if k.startswith(("mlp.", "post_attention_layernorm.")) and k in own and own[k].shape == v.shape}
            head.midlayer.load_state_dict(last, strict=False)
    head = head.float()
    head.set_embedding(io.embed.float())
    return head


def head_from(init: Eagle3Head, target, layers: tuple[int, ...]) -> Eagle3Head:
    """A head for ``target`` reading ``layers`` that starts from ``init``'s weights
    and draft vocabulary (``init`` may have read other layers: its ``fc`` is kept
    as the starting point for the new ones)."""
    hidden = int(target.config.get_text_config(decoder=True).hidden_size)
    if init.fc.in_features != 3 * hidden:
        raise InvalidArgument(f"--init head reads {init.fc.in_features} features; 3 layers of this target's "
                              f"{hidden} make {3 * hidden}")
    ids = init.to_target_ids(torch.arange(init.draft_vocab_size))
    head = new_head(target, DraftVocab(ids, init.t2d.numel(), 0.0), layers)
    if head.config.hidden_size != init.config.hidden_size:
        raise InvalidArgument(f"--init head is {init.config.hidden_size} wide; a head for this target is "
                              f"{head.config.hidden_size}")
    head.load_state_dict({k: v.float() for k, v in init.state_dict().items()})
    return head


def computes_the_same(a: torch.nn.Module, b: torch.nn.Module, width: int) -> bool:
    """Whether two modules agree on random inputs [4, width]."""
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(0))
    return torch.allclose(a(x.to(next(a.parameters()).dtype)).float(), b(x).float(), rtol=1e-3, atol=1e-4)


@torch.no_grad()
def target_batch(target, windows: torch.Tensor, layers: tuple[int, ...], t2d: torch.Tensor) -> TttBatch:
    """The target's outputs on ``windows`` [B, S+1], ready for the unrolled head."""
    out = target(input_ids=windows, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i] for i in layers], dim=-1)[:, :-1].float()    # [B, S, 3H]
    logits = out.logits[:, 1:].float()                                                   # [B, S, V]
    return TttBatch(features=features, tokens=windows, target=logits[..., t2d],
                    in_draft=t2d[logits.argmax(-1)])


def eagle3_losses(head: Eagle3Head, target, windows: torch.Tensor, ttt_steps: int):
    """windows: [B, S+1]. Returns (loss, metrics) of the unrolled head."""
    batch = target_batch(target, windows, head.layers, head.t2d)
    loss, metrics = unrolled_losses(head, head.embed_tokens, batch, ttt_steps)
    metrics["in_draft"] = float(batch.in_draft.float().mean())
    return loss, metrics


@torch.no_grad()
def heldout_draft_logits(head: Eagle3Head, target, windows: torch.Tensor):
    """The head's first-step logits on held-out ``windows`` [B, S+1] (teacher-forced
    with the target's features, as at the first draft level) at the positions
    where the target's argmax lies in the draft vocabulary, that argmax as a
    draft id, and the fraction of positions that had it:
    ([N, Vd] fp32, [N] int64, float)."""
    batch = target_batch(target, windows, head.layers, head.t2d)
    seq_len = batch.features.shape[1]
    positions = torch.arange(seq_len)[None].expand(windows.shape[0], -1)
    hidden = head(head.embed_tokens(windows[:, 1:]), head.project(batch.features), positions)
    logits = head.draft_logits(hidden)
    keep = batch.in_draft
    return logits[keep], batch.target.argmax(-1)[keep], float(keep.float().mean())


def calibrate_head3(head: Eagle3Head, target, heldout_stream: torch.Tensor, out_dir: Path,
                    seq_len: int = 256, windows: int = 8) -> dict:
    """Fit the head's greedy value temperature on held-out text, as for EAGLE-2
    heads, and write ``out_dir/calibration.json``."""
    logits, labels, in_draft = heldout_draft_logits(head.eval(), target,
                                                    eval_windows(heldout_stream, seq_len, max_windows=windows))
    if labels.numel() == 0:         # nothing to fit: the drafter's default
        record = {"greedy_value_temperature": 1.0,
                  "fitted_on": "nothing: no held-out target argmax is in the draft vocabulary"}
    else:
        record = calibration_record(logits, labels)
        record["fitted_on"] += " (positions whose target argmax is in the draft vocabulary)"
    record["target_argmax_in_draft_vocab"] = round(in_draft, 4)
    return write_calibration(record, out_dir)


def corpus_draft_vocab(stream: torch.Tensor, vocab_size: int, size: int, eos: int | None) -> DraftVocab:
    """The ``size`` most frequent tokens of the training stream, always with end-of-text."""
    return choose_draft_vocab(token_counts(stream, vocab_size), size, keep=() if eos is None else (eos,))


def chosen_layers(target, opts: Eagle3Options) -> tuple[int, ...]:
    """The hidden-state indices the head reads: ``opts.feature_layers`` checked, or the default."""
    depth = int(target.config.get_text_config(decoder=True).num_hidden_layers)
    layers = opts.feature_layers or training_feature_layers(depth)
    if any(not 0 <= i < depth for i in layers):
        raise InvalidArgument(f"feature layers must be HF hidden-state indices in 0..{depth - 1} "
                              f"(the inputs of the target's {depth} layers), got {list(layers)}")
    return tuple(sorted(layers))


def build_head(target, opts: Eagle3Options, counts: torch.Tensor, eos: int | None) -> tuple[Eagle3Head, DraftVocab]:
    """The head to train: from ``opts.init`` or new, its draft vocabulary the most
    frequent tokens of the training data (``counts`` [V])."""
    layers = chosen_layers(target, opts)
    if opts.init:
        depth = int(target.config.get_text_config(decoder=True).num_hidden_layers)
        head = head_from(load_head3(opts.init, target_layers=depth), target, layers)
        ids = head.to_target_ids(torch.arange(head.draft_vocab_size))
        return head, DraftVocab(ids, counts.numel(), float(counts[ids].sum()) / max(int(counts.sum()), 1))
    size = opts.draft_vocab or default_draft_vocab(counts.numel())
    vocab = choose_draft_vocab(counts, size, keep=() if eos is None else (eos,))
    return new_head(target, vocab, layers), vocab


def train_eagle3(target_dir: Path, train_texts: list[str], heldout_texts: list[str], out_dir: Path,
                 workdir: Path, cfg: TrainConfig, opts: Eagle3Options = Eagle3Options(),
                 progress: bool = True) -> dict:
    """Train (or resume) an EAGLE-3 head; a finished run writes the head in the
    reference layout, ``calibration.json`` and ``training_log.json`` to ``out_dir``."""
    torch.manual_seed(cfg.seed)
    target, tokenizer = frozen_target(target_dir)
    train_stream = tokenize_stream(train_texts, tokenizer, cache=workdir)
    heldout_stream = tokenize_stream(heldout_texts, tokenizer, cache=workdir)
    vocab_size = int(target.config.get_text_config(decoder=True).vocab_size)
    head, vocab = build_head(target, opts, token_counts(train_stream, vocab_size), tokenizer.eos_token_id)
    heldout = eval_windows(heldout_stream, cfg.seq_len, max_windows=16)

    def loss_fn(step: int):
        return eagle3_losses(head, target, sample_batch(train_stream, cfg.batch, cfg.seq_len, cfg.seed, step),
                             opts.ttt_steps)

    def eval_fn():
        _, metrics = eagle3_losses(head, target, heldout, opts.ttt_steps)
        return {f"heldout_{k}": round(v, 4) for k, v in metrics.items()}

    log = train(cfg, [p for p in head.parameters() if p.requires_grad], {"head": head}, loss_fn, eval_fn,
                workdir, progress)
    if not log["finished"]:
        return log          # interrupted: the checkpoint resumes it; export only a finished head
    head.eval()
    save_head(head, out_dir)
    calibrate_head3(head, target, heldout_stream, out_dir, cfg.seq_len)
    summary = {"target": str(target_dir), "feature_layers": list(head.layers), "ttt_steps": opts.ttt_steps,
               "init": opts.init,
               "draft_vocab": len(vocab), "draft_vocab_corpus_coverage": round(vocab.coverage, 4)}
    (Path(out_dir) / "training_log.json").write_text(json.dumps(
        {k: v for k, v in log.items() if k != "history"} | {"history_tail": log["history"][-20:]} | summary,
        indent=1))
    return log
