"""The target's features of each training conversation, computed once, kept on disk.

An EAGLE head is trained on the frozen target's hidden states; recomputing
them every step costs a full target forward per sequence per epoch. Here each
conversation goes through the target once and its record is stored:

    tokens [n] int32        the conversation (at most ``max_len`` tokens)
    mask   [n] bool         position p predicts an assistant token (``ChatTokens.loss_mask``)
    final  [n, H] bf16      the last decoder output (after the final norm): the
                            EAGLE-1/2 features, and the target's logits through its lm_head
    layers [n, k*H] bf16    (EAGLE-3) the hidden states the head reads, concatenated

Records are written in shards of ``SHARD`` conversations, each file written
whole (temporary name, then renamed), in the conversations' order; a stopped
extraction finds its complete shards and goes on with the next conversation.
A cache directory belongs to one (target, conversations, max_len, layers,
precision): its name is their hash. Shards are read back memory-mapped, so a cache larger than
memory trains.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from specdec.train.chat import ChatTokens

SHARD = 64
FEATURE_DTYPE = torch.bfloat16


def cache_dir(root: Path, target_dir: Path, tokens: list[ChatTokens], max_len: int,
              layers: tuple[int, ...], precision: str = "fp32") -> Path:
    head = [str(Path(target_dir).resolve()), max_len, list(layers)] + ([precision] if precision != "fp32" else [])
    key = hashlib.sha1(json.dumps(head).encode())
    for t in tokens:
        key.update(json.dumps([t.ids[:max_len], t.assistant[:max_len]]).encode())
    return Path(root) / f"features-{key.hexdigest()[:16]}"


def _shard_path(directory: Path, index: int) -> Path:
    return directory / f"shard-{index:05d}.pt"


@torch.no_grad()
def _records(target, chats: list[ChatTokens], max_len: int, layers: tuple[int, ...]) -> list[dict[str, torch.Tensor]]:
    """Each chat's record, the chats through the target as one right-padded batch
    (padding after a sequence does not reach its positions)."""
    ids = [c.ids[:max_len] for c in chats]
    batch = torch.zeros((len(ids), max(len(i) for i in ids)), dtype=torch.long)
    for row, i in enumerate(ids):
        batch[row, :len(i)] = torch.tensor(i)
    out = target(input_ids=batch, output_hidden_states=True, logits_to_keep=1)
    feats = torch.cat([out.hidden_states[i] for i in layers], dim=-1) if layers else None
    records = []
    for row, (c, i) in enumerate(zip(chats, ids)):
        n = len(i)
        r = {"tokens": torch.tensor(i, dtype=torch.int32), "mask": c.loss_mask()[:n] & (torch.arange(n) < n - 1),
             "final": out.hidden_states[-1][row, :n].to(FEATURE_DTYPE)}
        if feats is not None:
            r["layers"] = feats[row, :n].to(FEATURE_DTYPE)
        records.append(r)
    return records


def _shard(target, chats: list[ChatTokens], max_len: int, layers: tuple[int, ...], batch: int) -> dict:
    """The records of ``chats`` concatenated, with ``offsets`` [n + 1]; batches are
    formed from chats of similar length (less padding), the records kept in order."""
    order = sorted(range(len(chats)), key=lambda k: len(chats[k].ids))
    records: list[dict] = [{}] * len(chats)
    for lo in range(0, len(order), batch):
        which = order[lo:lo + batch]
        for k, r in zip(which, _records(target, [chats[k] for k in which], max_len, layers)):
            records[k] = r
    shard = {name: torch.cat([r[name] for r in records]) for name in records[0]}
    lengths = torch.tensor([len(r["tokens"]) for r in records])
    shard["offsets"] = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return shard


def extract(target, chats: list[ChatTokens], directory: Path, max_len: int, layers: tuple[int, ...] = (),
            batch: int = 8, progress: bool = True) -> tuple[int, int]:
    """Fill ``directory`` with the records of ``chats`` (module doc); returns how
    many conversations, and tokens, this call put through the target ((0, 0): all were cached)."""
    from tqdm import tqdm

    directory.mkdir(parents=True, exist_ok=True)
    shards = (len(chats) + SHARD - 1) // SHARD
    todo = [s for s in range(shards) if not _shard_path(directory, s).is_file()]
    computed = tokens = 0
    bar = tqdm(total=len(chats), initial=len(chats) - sum(len(chats[s * SHARD:(s + 1) * SHARD]) for s in todo),
               disable=not progress, dynamic_ncols=True, desc="features")
    for s in todo:
        part = chats[s * SHARD:(s + 1) * SHARD]
        tmp = _shard_path(directory, s).with_suffix(".tmp")
        torch.save(_shard(target, part, max_len, layers, batch), tmp)
        os.replace(tmp, _shard_path(directory, s))
        computed += len(part)
        tokens += sum(min(len(c.ids), max_len) for c in part)
        bar.update(len(part))
    bar.close()
    return computed, tokens


class FeatureCache:
    """The records of a filled cache directory, memory-mapped; ``batch`` pads them."""

    def __init__(self, directory: Path):
        paths = sorted(Path(directory).glob("shard-*.pt"))
        self.shards = [torch.load(p, mmap=True, weights_only=True) for p in paths]
        self.index = [(s, i) for s, shard in enumerate(self.shards) for i in range(len(shard["offsets"]) - 1)]

    def __len__(self) -> int:
        return len(self.index)

    def record(self, k: int) -> dict[str, torch.Tensor]:
        s, i = self.index[k]
        shard = self.shards[s]
        lo, hi = int(shard["offsets"][i]), int(shard["offsets"][i + 1])
        return {name: t[lo:hi] for name, t in shard.items() if name != "offsets"}

    def batch(self, which: list[int]) -> dict[str, torch.Tensor]:
        """Records ``which`` right-padded to the longest: tokens [B, L] int64, mask
        [B, L] bool (False on padding), final [B, L, H] and layers [B, L, kH] fp32."""
        records = [self.record(k) for k in which]
        width = max(len(r["tokens"]) for r in records)
        out = {}
        for name, t in records[0].items():
            dtype = torch.long if name == "tokens" else torch.bool if name == "mask" else torch.float32
            padded = torch.zeros((len(records), width, *t.shape[1:]), dtype=dtype)
            for row, r in enumerate(records):
                padded[row, :len(r[name])] = r[name].to(dtype)
            out[name] = padded
        return out

    def sample(self, batch: int, seed: int, step: int) -> dict[str, torch.Tensor]:
        """``batch`` records drawn as a pure function of (seed, step), as ``data.sample_batch`` does."""
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        return self.batch(torch.randint(0, len(self), (batch,), generator=gen).tolist())

    def assistant_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token is an assistant token (the tokens predicted where the mask is set)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for k in range(len(self)):
            r = self.record(k)
            nxt = r["tokens"][1:].long()[r["mask"][:-1]]
            counts += torch.bincount(nxt, minlength=vocab_size)
        return counts
