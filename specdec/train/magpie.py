"""User prompts written by the target itself ("Magpie", Xu et al., arXiv:2406.08464).

An aligned chat model fed only its template's user header (everything its
template writes before a user message's content) continues with a plausible
user turn, and ends it with the template's end-of-turn token. The header is
found by rendering a conversation whose one user message is a marker string
and cutting the text where the marker starts; the end-of-turn is the first
token of what the template writes after the marker (``<|im_end|>`` for ChatML,
``<|eot_id|>`` for Llama 3), so no template needs to be known by name.

Samples are drawn in batches (every row the same header: no padding) until
``n`` prompts are kept or ``max_draws`` samples were drawn. A sample is kept
when it ended with the end-of-turn (not cut by the length bound), is not
empty, is not degenerate (a long text of few distinct words) and its
normalised text (lower case, punctuation dropped, whitespace collapsed) was
not seen before: exact and near-exact repeats count once. The kept prompts
are split by a hash of that normalised text into a training file and a
held-out file, never the same prompt in both.

Prompts of earlier runs (``excluded_prompts``: every user turn of the
conversations given) count as seen from the start, so a dataset grows by
runs with new seeds without repeating a prompt it holds, held-out ones
included; a rerun must name the same files to replay its journal alike.

Every sample drawn is appended to a journal (``journal_path``) batch by
batch; a rerun replays it through the filter and draws on from there, its
random stream seeded by the draws already made, so a long run stopped
anywhere goes on without drawing again what it had (each batch is seeded by
the draws before it, so the prompts are those of an uninterrupted run).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from specdec.model.prompts import chat_text
from specdec.request.errors import UsageError
from specdec.train.regenerate import GenerateOptions, generate_batch, stop_ids

MARKER = "\x00MAGPIE-USER-CONTENT\x00"
MIN_DISTINCT_RATIO = 0.3       # degenerate: >= 8 words of which fewer than 30% distinct


@dataclass(frozen=True)
class MagpieOptions:
    n: int = 1000
    max_new_tokens: int = 128
    batch: int = 16
    temperature: float = 1.0
    heldout_frac: float = 0.05
    max_draws: int = 0             # 0: 4 * n
    seed: int = 0
    precision: str = "fp32"        # or "bf16" (GenerateOptions)


def user_header(tokenizer) -> tuple[str, str]:
    """(the text before a user message's content, the text the template closes it with)."""
    text = chat_text(tokenizer, [{"role": "user", "content": MARKER}], add_generation_prompt=False)
    if text.count(MARKER) != 1:
        raise UsageError("the chat template does not write a user message's content once, as given: "
                         "no user header to sample prompts from")
    head, tail = text.split(MARKER)
    return head, tail


def end_of_turn_ids(tokenizer, target, tail: str) -> list[int]:
    """The template's end-of-turn token (the first of ``tail``) and the target's EOS ids."""
    first = tokenizer(tail, add_special_tokens=False)["input_ids"][:1] if tail else []
    return sorted(set(first) | set(stop_ids(tokenizer, target)))


def normalised(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def degenerate(text: str) -> bool:
    words = normalised(text).split()
    return not words or (len(words) >= 8 and len(set(words)) < MIN_DISTINCT_RATIO * len(words))


def is_heldout(text: str, frac: float) -> bool:
    digest = hashlib.sha1(normalised(text).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64 < frac


class PromptFilter:
    """Keeps finished, non-degenerate, not-yet-seen prompts (module doc) and counts why others went."""

    def __init__(self, excluded: frozenset[str] = frozenset()):
        self.seen: set[str] = set(excluded)
        self.kept: list[str] = []
        self.dropped = {"unfinished": 0, "degenerate": 0, "duplicate": 0}
        self.drawn = 0              # samples drawn
        self.tokens = 0             # tokens generated (up to each sample's end-of-turn)
        self.replayed = (0, 0)      # (draws, tokens) of them read back from a journal

    def offer(self, text: str, finished: bool) -> bool:
        text = text.strip()
        reason = ("unfinished" if not finished else "degenerate" if degenerate(text)
                  else "duplicate" if normalised(text) in self.seen else None)
        if reason:
            self.dropped[reason] += 1
            return False
        self.seen.add(normalised(text))
        self.kept.append(text)
        return True


def excluded_prompts(paths: list[str]) -> frozenset[str]:
    """The normalised user turns of the conversations in ``paths`` (JSONL of messages, gzipped or not)."""
    from specdec.train.chat import read_chats

    return frozenset(normalised(m["content"]) for path in paths for chat in read_chats(path, need_assistant=False)
                     for m in chat if m["role"] == "user")


def journal_path(out: Path) -> Path:
    """Where ``chat-prompts --out OUT`` journals its draws."""
    return out.with_suffix(".draws.jsonl")


def replay(journal: Path, kept: PromptFilter, n: int) -> None:
    """Offer the journal's draws to ``kept`` again, as first drawn (a torn last line is dropped)."""
    if not journal.exists():
        return
    lines = journal.read_text(encoding="utf-8").splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines.pop()
        journal.write_text("".join(lines), encoding="utf-8")
    for line in lines:
        draw = json.loads(line)
        kept.tokens += draw["tokens"]
        kept.drawn += 1
        if len(kept.kept) < n:
            kept.offer(draw["text"], draw["finished"])
    kept.replayed = (kept.drawn, kept.tokens)


def sample_prompts(target, tokenizer, opts: MagpieOptions, progress: bool = True,
                   journal: Path | None = None, excluded: frozenset[str] = frozenset()) -> PromptFilter:
    """Draw user turns from the target's user header until ``opts.n`` are kept,
    none of them ``excluded``, going on from ``journal``'s draws and adding to it (module doc)."""
    import torch
    from tqdm import tqdm

    head, tail = user_header(tokenizer)
    header_ids = list(tokenizer(head, add_special_tokens=False)["input_ids"])
    stops = end_of_turn_ids(tokenizer, target, tail)
    gen = GenerateOptions(max_new_tokens=opts.max_new_tokens, batch=opts.batch, temperature=opts.temperature,
                          precision=opts.precision)
    kept = PromptFilter(excluded)
    if journal is not None:
        replay(journal, kept, opts.n)
    max_draws = opts.max_draws or 4 * opts.n
    bar = tqdm(total=opts.n, initial=len(kept.kept), disable=not progress, dynamic_ncols=True, desc="prompts")
    while len(kept.kept) < opts.n and kept.drawn < max_draws:
        rows = min(opts.batch, max_draws - kept.drawn)
        torch.manual_seed(opts.seed + kept.drawn)     # each batch by its place: a resumed run draws the same
        draws = []
        for ids, finished in generate_batch(target, [header_ids] * rows, stops, gen, stops[0]):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            draws.append({"text": text, "finished": bool(finished), "tokens": len(ids) + finished})
            kept.tokens += draws[-1]["tokens"]
            if len(kept.kept) < opts.n and kept.offer(text, finished):
                bar.update(1)
        kept.drawn += rows
        if journal is not None:
            with journal.open("a", encoding="utf-8") as f:
                f.write("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in draws))
    bar.close()
    return kept


def write_prompts(prompts: list[str], out: Path, heldout_out: Path, frac: float) -> tuple[int, int]:
    """Split ``prompts`` by hash (``is_heldout``) into two JSONL files of single-user-turn
    conversations; returns (train, held-out) counts."""
    held = [p for p in prompts if is_heldout(p, frac)]
    train = [p for p in prompts if not is_heldout(p, frac)]
    for path, part in ((out, train), (heldout_out, held)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}, ensure_ascii=False)
                                + "\n" for p in part), encoding="utf-8")
    return len(train), len(held)
