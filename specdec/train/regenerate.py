"""Self-distillation data: every assistant turn replaced by the target's own answer.

EAGLE heads draft the target's continuations, so they learn best from text the
target wrote (the EAGLE and SpecForge recipes regenerate their chat data).
Each conversation keeps its system and user turns; each assistant turn, in
order, becomes the target's answer to the conversation so far (earlier turns
already regenerated), and a conversation that ends with a user turn gets one
more, answered. Answers are greedy unless a temperature is given, at most
``max_new_tokens`` long, and end at the target's end-of-turn (its EOS ids).
At ``precision`` "bf16" the forwards run under bf16 autocast (``autocast``):
the answers are then those of the target's bf16 arithmetic, which can part
from its fp32 answers at near-ties (self-distillation data either way), at
~1.8x the tokens a second on a CPU with bf16 (SmolLM2-135M, batch 64, one
thread: docs/training.md).

Generation is batched: ``batch`` conversations at a time, left-padded with an
attention mask, one KV cache, finished rows leaving the batch. Conversations
are written to the output JSONL in input order, a block at a time, each with
the key of its source conversation; a rerun keeps the lines whose keys match
and generates only the rest.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.model.kv import with_cache
from specdec.model.prompts import chat_text
from specdec.train.chat import chat_key


@dataclass(frozen=True)
class GenerateOptions:
    max_new_tokens: int = 256
    batch: int = 16
    temperature: float = 0.0       # 0: greedy
    seed: int = 0
    precision: str = "fp32"        # or "bf16": the forwards under bf16 autocast


PRECISIONS = ("fp32", "bf16")


def autocast(precision: str, device: str = "cpu"):
    """The context a forward runs in: bf16 autocast (matrix products in bf16,
    reductions fp32; the weights as they are) or nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision != "bf16":
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return torch.autocast(device, dtype=torch.bfloat16)


def stop_ids(tokenizer, target) -> list[int]:
    """The ids that end a turn: the tokenizer's EOS and the generation config's."""
    ids = getattr(target.generation_config, "eos_token_id", None)
    ids = list(ids) if isinstance(ids, (list, tuple)) else ([] if ids is None else [ids])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, L] ids, [B, L] attention mask) with every prompt right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def next_tokens(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[b, V] -> [b]: the argmax, or a sample at ``temperature``."""
    if temperature <= 0:
        return logits.argmax(-1)
    return torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1)[:, 0]


def generate_batch(target, prompts: list[list[int]], stops: list[int], opts: GenerateOptions,
                   pad: int) -> list[tuple[list[int], bool]]:
    """Each prompt's continuation up to (not including) its first stop id, and
    whether it stopped (False: cut at ``max_new_tokens``). One batch with a KV
    cache; a row that stops leaves the batch (its cache rows dropped), so the
    steps cost what the unfinished rows cost."""
    with torch.no_grad(), autocast(opts.precision, target.device.type):
        return _generate(target, prompts, stops, opts, pad)


def _generate(target, prompts: list[list[int]], stops: list[int], opts: GenerateOptions,
              pad: int) -> list[tuple[list[int], bool]]:
    from transformers import DynamicCache

    ids, mask = left_padded(prompts, pad)                                  # [B, L]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    kw = with_cache(target, cache)
    logits = target(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                    **kw).logits[:, -1]
    last = positions[:, -1]                                                # [b] position of each row's last token
    rows = torch.arange(len(prompts))                                      # [b] the rows still generating
    stop = torch.tensor(stops)
    out: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    for step in range(opts.max_new_tokens):
        nxt = next_tokens(logits, opts.temperature)                        # [b]
        done = torch.isin(nxt, stop)
        for r, t, d in zip(rows.tolist(), nxt.tolist(), done.tolist()):
            if d:
                finished[r] = True
            else:
                out[r].append(t)
        keep = (~done).nonzero()[:, 0]
        if keep.numel() == 0 or step == opts.max_new_tokens - 1:
            break
        if keep.numel() < rows.numel():
            cache.batch_select_indices(keep)
            rows, mask, last, nxt = rows[keep], mask[keep], last[keep], nxt[keep]
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], 1)
        last = last + 1
        logits = target(input_ids=nxt[:, None], attention_mask=mask, position_ids=last[:, None], use_cache=True,
                        **kw).logits[:, -1]
    return list(zip(out, finished))


def answer_prompt(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer(chat_text(tokenizer, messages), add_special_tokens=False)["input_ids"])


def answer_slots(messages: list[dict]) -> list[int]:
    """Where the target answers: each assistant turn's index, and the end after a trailing user turn."""
    slots = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
    return slots + [len(messages)] if messages[-1]["role"] == "user" else slots


def regenerate_block(target, tokenizer, chats: list[list[dict]], opts: GenerateOptions,
                     stops: list[int], pad: int) -> tuple[list[list[dict]], int]:
    """The conversations of one block with every assistant turn the target's (module doc),
    and how many tokens were generated: round r answers the r-th slot of every
    conversation that has one, in one batch."""
    slots = [answer_slots(c) for c in chats]
    out: list[list[dict]] = [[] for _ in chats]
    pos = [0] * len(chats)          # how much of each source conversation is in out
    tokens = 0
    for r in range(max(len(s) for s in slots)):
        ready = [i for i in range(len(chats)) if r < len(slots[i])]
        for i in ready:
            out[i].extend(chats[i][pos[i]:slots[i][r]])
            pos[i] = slots[i][r] + 1
        answers = generate_batch(target, [answer_prompt(tokenizer, out[i]) for i in ready], stops, opts, pad)
        for i, (ids, finished) in zip(ready, answers):
            tokens += len(ids) + finished
            out[i].append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=False)})
    for i, c in enumerate(chats):
        out[i].extend(c[pos[i]:])
    return out, tokens


def _kept(path: Path, keys: list[str]) -> list[str]:
    """The lines of ``path`` that are, in order, the regenerations of ``keys``' first conversations."""
    if not path.is_file():
        return []
    kept = []
    for line, key in zip(path.read_text(encoding="utf-8").splitlines(), keys):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break
        if record.get("source") != key:
            break
        kept.append(line)
    return kept


def regenerate(target, tokenizer, chats: list[list[dict]], out: Path, opts: GenerateOptions,
               progress: bool = True) -> tuple[list[list[dict]], int, int]:
    """Write (or complete) ``out`` with the regenerated ``chats``; returns them,
    how many were generated in this call and the tokens generated."""
    from tqdm import tqdm

    keys = [chat_key(c) for c in chats]
    lines = _kept(out, keys)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    torch.manual_seed(opts.seed)
    stops = stop_ids(tokenizer, target)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    start, tokens = len(lines), 0
    bar = tqdm(total=len(chats), initial=start, disable=not progress, dynamic_ncols=True, desc="regenerate")
    with out.open("a", encoding="utf-8") as f:
        for lo in range(start, len(chats), opts.batch):
            block, n = regenerate_block(target, tokenizer, chats[lo:lo + opts.batch], opts, stops, pad)
            tokens += n
            for key, messages in zip(keys[lo:], block):
                f.write(json.dumps({"source": key, "messages": messages}, ensure_ascii=False) + "\n")
            f.flush()
            bar.update(len(block))
    bar.close()
    result = [json.loads(line)["messages"] for line in out.read_text(encoding="utf-8").splitlines()]
    return result, len(chats) - start, tokens
