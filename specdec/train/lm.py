"""Train a Llama-architecture causal LM from scratch (the demo target and the
small draft LM), resumable, exported with ``save_pretrained`` (safetensors)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.train.data import eval_windows, sample_batch, tokenize_stream, unigram_loss
from specdec.train.loop import TrainConfig, train


@dataclass(frozen=True)
class LmShape:
    hidden: int = 192
    layers: int = 20
    heads: int = 4              # query heads; head_dim = hidden / heads
    kv_heads: int = 2           # grouped-query attention; tensor parallelism needs both divisible by --tp
    intermediate: int = 512
    max_positions: int = 2048


def build_llama(shape: LmShape, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate, max_position_embeddings=shape.max_positions,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False, rope_theta=10000.0,
    )
    return LlamaForCausalLM(config)


def export_fp16(model, out_dir: Path, tokenizer=None) -> None:
    """Save in half precision (the bundled copy must stay small); the engines
    load it back as fp32 on CPU."""
    half = copy.deepcopy(model).to(torch.float16)
    half.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def train_lm(
    tokenizer_dir: Path, train_texts: list[str], heldout_texts: list[str], out_dir: Path,
    workdir: Path, shape: LmShape, cfg: TrainConfig, progress: bool = True,
) -> dict:
    from transformers import AutoTokenizer

    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    train_stream = tokenize_stream(train_texts, tokenizer, cache=workdir)
    heldout_stream = tokenize_stream(heldout_texts, tokenizer, cache=workdir)
    model = build_llama(shape, tokenizer)
    heldout = eval_windows(heldout_stream, cfg.seq_len, max_windows=64)
    baseline = unigram_loss(train_stream, heldout_stream, len(tokenizer))

    def loss_fn(step: int):
        batch = sample_batch(train_stream, cfg.batch, cfg.seq_len, cfg.seed, step)
        out = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone())
        return out.loss, {}

    def eval_fn():
        losses = [float(model(input_ids=w[None, :-1], labels=w[None, :-1].clone()).loss) for w in heldout]
        return {"heldout_loss": sum(losses) / len(losses), "unigram_loss": baseline}

    log = train(cfg, list(model.parameters()), {"model": model}, loss_fn, eval_fn, workdir, progress)
    log.update({"params": sum(p.numel() for p in model.parameters()),
                "train_tokens": int(len(train_stream)), "heldout_tokens": int(len(heldout_stream)),
                "unigram_loss": baseline, "shape": shape.__dict__})
    if not log["finished"]:
        return log          # interrupted: the checkpoint resumes it; export only a finished model
    model.eval()
    export_fp16(model, out_dir, tokenizer)
    (Path(out_dir) / "training_log.json").write_text(json.dumps(
        {k: v for k, v in log.items() if k != "history"} | {"history_tail": log["history"][-20:]}, indent=1))
    return log
