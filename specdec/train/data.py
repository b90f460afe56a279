"""Token streams for training: tokenize a corpus once, cache it, sample windows.

A stream is one int32 tensor: each file's tokens followed by EOS. Training
windows are drawn with a generator seeded by (seed, step), so a resumed run
sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch


def tokenize_stream(texts: list[str], tokenizer, cache: Path | None = None) -> torch.Tensor:
    """Concatenate ``tokenizer(text) + [eos]`` for every text -> int32 [N]."""
    key = hashlib.sha1()
    for t in texts:
        key.update(hashlib.sha1(t.encode("utf-8", "replace")).digest())
    key.update(str(len(tokenizer)).encode())
    if cache is not None:
        path = Path(cache) / f"tokens-{key.hexdigest()[:16]}.pt"
        if path.exists():
            return torch.load(path)
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    stream = torch.tensor(ids, dtype=torch.int32)
    if cache is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(stream, path)
    return stream


def sample_batch(stream: torch.Tensor, batch: int, seq_len: int, seed: int, step: int) -> torch.Tensor:
    """[batch, seq_len + 1] windows of ``stream``, a pure function of (seed, step)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=gen)
    offsets = torch.arange(seq_len + 1)
    return stream[starts[:, None] + offsets[None, :]].long()


def eval_windows(stream: torch.Tensor, seq_len: int, max_windows: int) -> torch.Tensor:
    """Evenly spaced, non-overlapping held-out windows [n, seq_len + 1]."""
    n = min(max_windows, (len(stream) - 1) // (seq_len + 1))
    stride = (len(stream) - 1) // n
    starts = torch.arange(n) * stride
    return stream[starts[:, None] + torch.arange(seq_len + 1)[None, :]].long()


def unigram_loss(train: torch.Tensor, heldout: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of held-out tokens under the train unigram
    distribution with add-one smoothing: the baseline a real LM must beat."""
    counts = torch.bincount(train.long(), minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[heldout.long()].mean())


def frozen_target(target_dir):
    """The target model, every parameter frozen, and its tokenizer: what each head trainer starts from."""
    from specdec.model.loading import ModelSpec, load_causal_lm, load_tokenizer

    target = load_causal_lm(ModelSpec(str(target_dir)))
    target.requires_grad_(False)
    return target, load_tokenizer(target_dir)
