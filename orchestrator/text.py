"""Text on the orchestrator: tokenizing prompts, streaming detokenization, stop strings.

Only the ``tokenizers`` package (no transformers, no torch): the tokenizer is
``tokenizer.json`` from a model directory, the EOS id comes from
``tokenizer_config.json`` (``eos_token``) or else ``config.json``
(``eos_token_id``).

Streaming rules:
- A token may end in the middle of a multi-byte UTF-8 character (byte-level
  BPE splits emoji and CJK characters across tokens). Decoding such a prefix
  yields U+FFFD at its end, so text is released only up to the last complete
  character; the rest waits for the next token (or for ``finish``). The
  concatenated deltas equal ``decode(all tokens)``.
- Decoding works on a short window of recent tokens, so each token costs a
  constant amount of work however long the generation gets.
- Stop strings may span tokens and chunks: text that could still grow into a
  stop string is held back, and nothing from the first stop string on is ever
  emitted. When a stop string completes, the output keeps the tokens needed to
  cover the text before it (the last kept token may reach into the stop
  string; its text is cut there).
- A token id is streamed only once all of its text has been, so a stop
  string completed later never has to take back a token already sent.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

from tokenizers import Tokenizer

from specdec.request.params import check_stop_strings

REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class TextTokenizer:
    tokenizer: Tokenizer
    eos_ids: frozenset[int]

    @classmethod
    def load(cls, directory: str | Path) -> TextTokenizer:
        d = Path(directory)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"tokenizer directory {d} has no tokenizer.json")
        tok = Tokenizer.from_file(str(path))
        return cls(tok, frozenset(_eos_ids(d, tok)))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc.msg})") from None


def _eos_ids(directory: Path, tok: Tokenizer) -> set[int]:
    eos = _read_json(directory / "tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if isinstance(eos, str) and tok.token_to_id(eos) is not None:
        return {tok.token_to_id(eos)}
    ids = _read_json(directory / "config.json").get("eos_token_id")
    if isinstance(ids, int):
        return {ids}
    if isinstance(ids, list):
        return {i for i in ids if isinstance(i, int)}
    return set()


def validate_stop_strings(stop: Sequence[str]) -> list[str]:
    """InvalidArgument naming the field ``stop`` for unusable stop strings (``specdec.request.params`` bounds)."""
    return list(check_stop_strings(stop))


class IncrementalDetokenizer:
    """Token ids in, complete UTF-8 text out.

    ``text`` is the text released so far. A *settle point* is a token count
    at which the tokens decode completely (no character waits for more
    bytes): ``marks_tokens[j]`` tokens give ``marks_chars[j]`` characters.
    """

    CONTEXT = 4  # tokens decoded before the new ones, so decoders see their neighbours

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.tokens: list[int] = []
        self.text = ""
        self.marks_tokens = [0]
        self.marks_chars = [0]
        self._start = 0  # window: tokens[_start:]
        self._done = 0   # characters of decode(window) already in `text`

    def push(self, token: int) -> str:
        """Add one token; returns the newly released text."""
        self.tokens.append(token)
        window = self.decode(self.tokens[self._start:])
        stable = window.rstrip(REPLACEMENT)
        delta = ""
        if len(stable) > self._done:
            delta = stable[self._done:]
            self.text += delta
            self._done = len(stable)
        if len(stable) == len(window):
            self._mark()
            if len(self.tokens) - self._start > 2 * self.CONTEXT:
                # The window decodes completely: restart it a few tokens back.
                self._start = len(self.tokens) - self.CONTEXT
                self._done = len(self.decode(self.tokens[self._start:]))
        return delta

    def flush(self) -> str:
        """Release everything, incomplete bytes included (as U+FFFD)."""
        window = self.decode(self.tokens[self._start:])
        delta = window[self._done:]
        self.text += delta
        self._done = len(window)
        self._mark()
        return delta

    def settled_tokens(self, text_end: int) -> int:
        """Most tokens whose text lies within ``text[:text_end]``."""
        return self.marks_tokens[bisect.bisect_right(self.marks_chars, text_end) - 1]

    def covering_tokens(self, text_end: int, at_least: int = 0) -> int:
        """Fewest tokens (>= at_least) whose complete characters reach ``text_end``."""
        lo, hi = at_least, len(self.tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.decode(self.tokens[:mid]).rstrip(REPLACEMENT)) >= text_end:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _mark(self) -> None:
        if self.marks_tokens[-1] == len(self.tokens):
            self.marks_chars[-1] = len(self.text)
        else:
            self.marks_tokens.append(len(self.tokens))
            self.marks_chars.append(len(self.text))


class Delta(NamedTuple):
    token_ids: list[int]
    text: str


class TextStream:
    """Generated tokens -> chunks for the stream, cut at the first stop string.

    ``stop_check`` plugs into ``specdec.request.decoding.StopCriteria``: it sees every
    committed token and reports how many tokens to keep once a stop string
    has completed. ``take`` returns what is safe to send now and ``finish``
    the rest once generation is over. A token is sent once its text has been
    sent, so a stop string found later never has to take back a sent token.
    """

    def __init__(self, tokenizer: TextTokenizer, stop: Sequence[str] = ()):
        self.detok = IncrementalDetokenizer(tokenizer.decode)
        self.stop = validate_stop_strings(stop)
        self.stop_at: int | None = None  # text offset where the first stop string begins
        self.keep: int | None = None     # tokens kept once a stop string completed
        self.sent_tokens = 0
        self.sent_chars = 0
        self._searched = 0               # stop strings were looked for in text[:_searched]

    @property
    def text(self) -> str:
        """The output text so far (sent, or to be sent by ``take``/``finish``)."""
        return self.detok.text[:self.stop_at] if self.stop_at is not None else self.detok.text

    @property
    def tokens(self) -> list[int]:
        return self.detok.tokens[:self.keep] if self.keep is not None else list(self.detok.tokens)

    def stop_check(self, tokens: list[int]) -> int | None:
        """Tokens generated so far -> how many to keep if a stop string completed."""
        if self.stop_at is not None:
            return None
        for tok in tokens[len(self.detok.tokens):]:
            self.detok.push(tok)
        if not self.stop:
            return None
        text = self.detok.text
        longest = max(len(s) for s in self.stop)
        start = max(self.sent_chars, self._searched - longest + 1)
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        self._searched = len(text)
        if not hits:
            return None
        self.stop_at = min(hits)
        self.keep = self.detok.covering_tokens(self.stop_at, at_least=self.sent_tokens)
        return self.keep

    def take(self) -> Delta:
        """What may be sent now."""
        if self.stop_at is not None:
            return self._send(self.keep, self.stop_at)
        text_end = len(self.detok.text) - self._held_back()
        return self._send(self.detok.settled_tokens(text_end), text_end)

    def finish(self) -> Delta:
        """The rest, once no more tokens will come."""
        if self.stop_at is not None:
            return self._send(self.keep, self.stop_at)
        self.detok.flush()
        return self._send(len(self.detok.tokens), len(self.detok.text))

    def _send(self, token_end: int, text_end: int) -> Delta:
        delta = Delta(self.detok.tokens[self.sent_tokens:token_end], self.detok.text[self.sent_chars:text_end])
        self.sent_tokens = max(self.sent_tokens, token_end)
        self.sent_chars = max(self.sent_chars, text_end)
        return delta

    def _held_back(self) -> int:
        """Length of the longest unsent suffix that could begin a stop string."""
        pending = self.detok.text[self.sent_chars:]
        best = 0
        for s in self.stop:
            for k in range(min(len(pending), len(s) - 1), best, -1):
                if pending.endswith(s[:k]):
                    best = k
                    break
        return best
