"""The drafter interface and the KV-cached tree expansion shared by model drafters.

A drafter session mirrors the committed tokens. Its model has consumed a
prefix of them (``fed``); the rest are *pending* and are fed at the start of
the next draft, whose last output gives the root's children. Tree expansion
then appends draft-only KV slots, each visible to its tree descendants only,
and drops them when the tree is built: the drafter's cache never holds a token
that was not committed.
"""

from __future__ import annotations

import json
import math
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from specdec import kv
from specdec.errors import InvalidArgument
from specdec.sessions import SessionTable
from specdec.tree import DraftTree, Frontier, TreeConfig, build_tree


@dataclass
class DraftSession:
    tokens: list[int]                      # committed tokens (last = root)
    features: list[torch.Tensor] = field(default_factory=list)  # [H] preceding tokens[i+1]
    cache: object = None
    fed: int = 0                           # inputs already in `cache`
    state: object = None                   # drafter-specific (the n-gram index)
    root_out: tuple | None = None          # (hidden [H], log-probs [V]) of the last fed input
    lock: threading.Lock = field(default_factory=threading.Lock)
    greedy: bool = False                   # the verifier accepts by argmax (temperature 0)


CALIBRATION_FILE = "calibration.json"


def read_value_temperature(model_dir: str | Path | None) -> float:
    """The greedy value temperature fitted for a draft model (``calibration.json``
    beside its weights, written by ``specdec train eagle`` / ``calibrate``); 1.0
    when the directory has none, as for a released EAGLE head."""
    if model_dir is None:
        return 1.0
    path = Path(model_dir) / CALIBRATION_FILE
    if not path.is_file():
        return 1.0
    try:
        value = json.loads(path.read_text())["greedy_value_temperature"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: expected a JSON object with greedy_value_temperature ({exc})") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{path}: greedy_value_temperature must be a number > 0, got {value!r}")
    return float(value)


class Drafter(ABC):
    """prefill -> (draft -> commit)* -> release, per session id.

    Node values rank the draft tree; they should estimate how likely the
    verifier is to accept a path. A greedy verifier accepts a token when it is
    the target's argmax, which a head trained on the target's soft distribution
    under-states: for greedy sessions the log-probs are sharpened by
    ``greedy_value_temperature`` (fitted on held-out text), sampled sessions use
    the draft distribution as it is. Either way the output is unchanged."""

    needs_features = False
    name = "drafter"

    def __init__(self, vocab_size: int, max_sessions: int = 64, ttl_s: float = 600.0,
                 greedy_value_temperature: float = 1.0):
        self.vocab_size = vocab_size
        self.sessions: SessionTable[DraftSession] = SessionTable(max_sessions, ttl_s)
        self.greedy_value_temperature = greedy_value_temperature

    def prefill(self, sid: str, tokens: list[int], features: torch.Tensor | None = None,
                greedy: bool = False) -> None:
        """tokens: prompt + first generated token; features: [len(tokens) - 1, H]
        target hidden states at the prompt positions (EAGLE only); greedy: the
        session's verifier decodes at temperature 0."""
        if not tokens:
            raise InvalidArgument("drafter prefill needs at least one token")
        if self.needs_features and len(tokens) < 2:
            # its first input pairs a prompt token's feature with the token after it
            raise InvalidArgument(f"{self.name} drafter prefill needs at least 2 tokens (prompt + first "
                                  f"generated token), got {len(tokens)}")
        sess = DraftSession(tokens=[], greedy=greedy)
        self._append(sess, tokens, features, first=True)
        self.sessions.add(sid, sess, replace=True)

    def commit(self, sid: str, tokens: list[int], features: torch.Tensor | None = None) -> None:
        """tokens newly committed (accepted + bonus); features: [len(tokens), H]."""
        sess = self.sessions.get(sid)
        with sess.lock:
            self._append(sess, tokens, features, first=False)

    def rollback(self, sid: str, length: int) -> None:
        """Keep the first ``length`` committed tokens."""
        sess = self.sessions.get(sid)
        with sess.lock:
            if not 1 <= length <= len(sess.tokens):
                raise InvalidArgument(f"rollback length must be in [1, {len(sess.tokens)}], got {length}")
            del sess.tokens[length:]
            del sess.features[length - 1:]
            sess.state = None
            sess.root_out = None
            if sess.cache is not None and sess.fed >= self._inputs_for(length):
                sess.fed = max(0, self._inputs_for(length) - 1)   # re-feed the root's input next draft
                kv.truncate(sess.cache, sess.fed)

    def release(self, sid: str) -> bool:
        return self.sessions.pop(sid) is not None

    def draft(self, sid: str, cfg: TreeConfig) -> DraftTree:
        sess = self.sessions.get(sid)
        with sess.lock:
            return self._draft(sess, self.session_config(sess, cfg))

    def session_config(self, sess: DraftSession, cfg: TreeConfig) -> TreeConfig:
        """``cfg`` with the value temperature this session drafts with."""
        if cfg.value_temperature is not None:
            return cfg
        return replace(cfg, value_temperature=self.greedy_value_temperature if sess.greedy else 1.0)

    # -- for subclasses ----------------------------------------------------------
    @abstractmethod
    def _draft(self, sess: DraftSession, cfg: TreeConfig) -> DraftTree: ...

    def _inputs_for(self, n_tokens: int) -> int:
        """How many model inputs ``n_tokens`` committed tokens make."""
        return n_tokens

    def _append(self, sess: DraftSession, tokens: list[int], features, first: bool) -> None:
        bad = next((t for t in tokens if not 0 <= int(t) < self.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(f"token id {bad} is outside the drafter vocabulary [0, {self.vocab_size})")
        if self.needs_features:
            want = len(tokens) - 1 if first else len(tokens)
            if features is None or features.ndim != 2 or features.shape[0] != want:
                got = None if features is None else tuple(features.shape)
                raise InvalidArgument(f"EAGLE drafter needs features of shape [{want}, H], got {got}")
            sess.features.extend(features.float().unbind(0))
        sess.tokens.extend(int(t) for t in tokens)


class CachedTreeDrafter(Drafter):
    """A drafter whose model runs over a KV cache (EAGLE head or small LM)."""

    @abstractmethod
    def _new_cache(self): ...

    @abstractmethod
    def _feed_pending(self, sess: DraftSession) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed inputs [fed, total) into the cache; return (last hidden [H], log-probs [V])."""

    @abstractmethod
    def _step(self, sess: DraftSession, tokens: torch.Tensor, parent_hidden: torch.Tensor,
              positions: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One tree level: tokens [k], parent_hidden [k, H], positions [k], additive
        mask [1, 1, k, cache + k]. Returns hidden [k, H], log-probs [k, V]."""

    @torch.inference_mode()
    def _draft(self, sess: DraftSession, cfg: TreeConfig) -> DraftTree:
        if sess.cache is None:
            sess.cache = self._new_cache()
        if sess.fed < self._inputs_for(len(sess.tokens)) or sess.root_out is None:
            sess.root_out = self._feed_pending(sess)
        root_hidden, root_logp = sess.root_out    # a second draft with nothing new reuses it
        committed = kv.seq_len(sess.cache)
        root_pos = committed - 1
        hidden = {0: root_hidden}          # pool id -> model output at that node
        slot: dict[int, int] = {}          # pool id -> draft KV slot (0-based after `committed`)
        parent_of: dict[int, int] = {0: -1}

        def expand(frontier: Frontier) -> torch.Tensor:
            if frontier.depth == 0:
                return root_logp[None]
            nodes, parents = frontier.nodes.tolist(), frontier.parents.tolist()
            k, used = len(nodes), len(slot)
            allowed = torch.zeros(k, used + k, dtype=torch.bool)
            for row, (node, parent) in enumerate(zip(nodes, parents)):
                parent_of[node] = parent
                a = parent
                while a > 0:               # the root's input is committed, not a draft slot
                    allowed[row, slot[a]] = True
                    a = parent_of[a]
                allowed[row, used + row] = True
            mask = torch.zeros(k, committed + used + k)
            mask[:, committed:].masked_fill_(~allowed, torch.finfo(torch.float32).min)
            positions = torch.full((k,), root_pos + frontier.depth, dtype=torch.long)
            parent_h = torch.stack([hidden[p] for p in parents])
            out_h, logp = self._step(sess, frontier.tokens, parent_h, positions, mask[None, None])
            for row, node in enumerate(nodes):
                slot[node] = used + row
                hidden[node] = out_h[row]
            return logp

        try:
            return build_tree(sess.tokens[-1], expand, cfg)
        finally:
            kv.truncate(sess.cache, committed)
