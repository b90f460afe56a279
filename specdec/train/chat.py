"""Conversations as training data: JSONL of ``{"messages": [{"role", "content"}, ...]}``
rendered with the target's chat template, and which tokens are the assistant's.

A conversation's tokens are its whole rendering (``specdec.model.prompts.chat_text``
without a generation prompt) encoded as the target reads it. The assistant's
tokens are found by rendering the conversation prefix by prefix, never by
searching the output for role names: for the assistant turn i,

    before_i = render(messages[:i], add_generation_prompt=True)    # ... up to the assistant header
    through_i = render(messages[:i + 1], add_generation_prompt=False)

and the characters ``through_i[len(before_i):]`` (the turn's content and what
the template closes it with, e.g. ``<|im_end|>\\n`` or ``<|eot_id|>``) are the
assistant's. A template for which a prefix does not render as a prefix of the
whole (one that rewrites earlier turns) is refused. Tokens are mapped to
characters by the fast tokenizer's offsets: a token is the assistant's when it
starts inside such a span.

The loss mask of a sequence is over *positions*: position p is trained when the
token it predicts, p + 1, is the assistant's (``loss_mask``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.model.prompts import chat_text
from specdec.request.errors import UsageError

ROLES = ("system", "user", "assistant")
HELDOUT_MODULUS = 20        # a conversation is held out when its hash % 20 == 0 (~5%)


@dataclass(frozen=True)
class ChatTokens:
    ids: list[int]              # the rendered conversation, encoded
    assistant: list[bool]       # per token: it belongs to an assistant turn

    def loss_mask(self) -> torch.Tensor:
        """bool [n]: position p predicts an assistant token (p + 1); the last predicts nothing."""
        return torch.tensor(self.assistant[1:] + [False], dtype=torch.bool)


def check_messages(messages, where: str, need_assistant: bool = True) -> list[dict]:
    """``messages`` as a list of {"role", "content"}; a one-line UsageError naming ``where`` otherwise."""
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"{where}: \"messages\" must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise UsageError(f"{where}: message {i} must be an object with a string \"content\"")
        if m.get("role") not in ROLES:
            raise UsageError(f"{where}: message {i} has unknown role {m.get('role')!r} (one of {', '.join(ROLES)})")
        out.append({"role": m["role"], "content": m["content"]})
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise UsageError(f"{where}: the conversation has no assistant turn to train on")
    return out


def read_chats(path: str | Path, need_assistant: bool = True) -> list[list[dict]]:
    """The conversations of a JSONL file (gzipped when its name ends in .gz), each
    checked (``check_messages``)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"chat data file not found: {path}")
    try:
        text = gzip.decompress(path.read_bytes()).decode("utf-8") if path.suffix == ".gz" else \
            path.read_text(encoding="utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: not readable as {'gzipped ' if path.suffix == '.gz' else ''}UTF-8 JSONL ({exc})") \
            from None
    chats = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict) or "messages" not in record:
            raise UsageError(f"{where}: no \"messages\" (expected {{\"messages\": [{{\"role\", \"content\"}}, ...]}})")
        chats.append(check_messages(record["messages"], where, need_assistant))
    if not chats:
        raise UsageError(f"{path}: no conversations")
    return chats


def read_chat_files(paths: list[str | Path], need_assistant: bool = True) -> list[list[dict]]:
    """The conversations of several files (``read_chats``) as one dataset, in order, each
    conversation once however many times the files hold it."""
    chats, seen = [], set()
    for path in paths:
        for chat in read_chats(path, need_assistant):
            if (key := chat_key(chat)) not in seen:
                seen.add(key)
                chats.append(chat)
    return chats


def write_chats(chats: list[list[dict]], path: Path) -> None:
    path.write_text("".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in chats),
                    encoding="utf-8")


def chat_key(messages: list[dict]) -> str:
    return hashlib.sha1(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def split_chats(chats: list[list[dict]]) -> tuple[list[list[dict]], list[list[dict]]]:
    """(train, held-out) by a hash of each conversation; at least one of each when there are two."""
    held_at = {i for i, c in enumerate(chats) if int(chat_key(c)[:12], 16) % HELDOUT_MODULUS == 0} \
        or {len(chats) - 1}
    held = [c for i, c in enumerate(chats) if i in held_at]
    return [c for i, c in enumerate(chats) if i not in held_at] or held, held


def require_template(tokenizer, target: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"the target {target} has no chat template: chat data needs one "
                         f"(chat_template.jinja or tokenizer_config.json's chat_template)")


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The whole rendering and the character spans [start, end) of its assistant turns (module doc)."""
    whole = chat_text(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = chat_text(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        through = chat_text(tokenizer, messages[:i + 1], add_generation_prompt=False)
        if not (through.startswith(before) and whole.startswith(through)):
            raise UsageError("the chat template does not render a conversation's prefixes as prefixes of it: "
                             "its assistant turns cannot be located")
        if len(through) > len(before):
            spans.append((len(before), len(through)))
    return whole, spans


def chat_tokens(tokenizer, messages: list[dict]) -> ChatTokens:
    """The conversation's token ids and which of them are the assistant's."""
    text, spans = assistant_spans(tokenizer, messages)
    if not getattr(tokenizer, "is_fast", False):
        raise UsageError("chat training needs a fast tokenizer (tokenizer.json) to map tokens to text")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    inside = [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]
    return ChatTokens(list(enc["input_ids"]), inside)
