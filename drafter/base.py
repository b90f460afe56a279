"""The drafter interface (sessions, commits, rollbacks, drafting ahead and the
constraint a session drafts under); model drafters build on ``drafter.cached``.

A drafter session mirrors the committed tokens. Its model has consumed a
prefix of them (``fed``); the rest are *pending* and are fed at the start of
the next draft, whose last output gives the root's children. Tree expansion
then appends draft-only KV slots, each visible to its tree descendants only,
and drops them when the tree is built: the drafter's cache never holds a token
that was not committed.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from specdec.model import kv
from specdec.model import prefix_cache as pc
from specdec.request.errors import InvalidArgument
from specdec.request.params import SamplingParams, TreeParams
from specdec.serving.sessions import SessionTable
from specdec.tree.build import DraftTree
from specdec.tree.grammar import GrammarState
from specdec.tree.placed import DeviceTree
from specdec.tree.proposals import ProposalSampler


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
    sampling: SamplingParams | None = None  # the session's sampling (sampled proposals follow it)
    seed: int = 0                          # of the session's proposal draws
    record: TreeRecord | None = None       # the tree handed out by the last draft (drafting ahead)
    ahead: dict = field(default_factory=dict)   # commit tokens -> TreeRecord of a tree drafted ahead
    ahead_s_per_end: float = 0.0           # the last forest drafted ahead took this long per accepted path
    grammar: GrammarState | None = None    # a constrained session's matcher at the committed tokens
    fresh: tuple | None = None             # the last commit as it arrived: (its first input, features [k, H],
                                           # its tokens [k] on the device or None), fed as they are


@dataclass(frozen=True)
class TreeRecord:
    """A drafted tree with its model's output at the nodes it expanded, kept so
    that the next round can be drafted from it while the verifier checks it."""

    tree: DraftTree
    hidden: torch.Tensor   # [n, H] model output at each node with children (row 0: the root); zeros elsewhere


def on_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` on ``device`` (in ``dtype``; None: its own): ``t`` itself where it is
    there already, as the verifier's features and the model's outputs are; a host
    tensor is copied up (a host sync on a device)."""
    want = torch.device(device)
    if t.device.type == want.type and want.index in (None, t.device.index) and dtype in (None, t.dtype):
        return t
    return t.to(device, dtype if dtype is not None else t.dtype)


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
    the draft distribution as it is. Either way the output is unchanged.

    Sessions that sample (temperature > 0) get sampled proposals by default
    where the drafter has a distribution (``samples_proposals``): children drawn
    from it under the session's sampling params, shipped with the tree
    (specdec.tree.proposals). The draws are seeded by the session's seed and the
    committed length, so a seed reproduces the tree.

    Constrained sessions (``SamplingParams.constraint``) draft under the
    grammar when the drafter has a ``grammar_tokenizer``: each node's
    proposals are masked by the grammar along its own path
    (``specdec.tree.grammar.masked_expand``; cached-tree drafters). Without
    one, or where the drafter's state cannot follow the grammar, drafts are
    unmasked: the verifier's mask keeps the output exact either way, only
    fewer drafted tokens are accepted."""

    needs_features = False
    name = "drafter"
    drafts_ahead = False                   # draft_ahead can return trees
    samples_proposals = False              # can draw sampled proposals
    defers = True                          # draft(deferred=True) may leave a tree on the device, unread
    takes_token_ids = True                 # commit(token_ids=...): the committed tokens on the device

    grammar_tokenizer = None               # llguidance's tokenizer (``specdec.tree.grammar``); None: unmasked drafts

    def __init__(self, vocab_size: int, max_sessions: int = 64, ttl_s: float = 600.0,
                 greedy_value_temperature: float = 1.0):
        self.vocab_size = vocab_size
        self.sessions: SessionTable[DraftSession] = SessionTable(max_sessions, ttl_s)
        self.greedy_value_temperature = greedy_value_temperature
        self.prefix = pc.PrefixCache(0)        # ``use_prefix_cache``: off until then

    def use_prefix_cache(self, max_tokens: int, exact: bool = False) -> None:
        """Keep the model's K/V of prompt prefixes for later sessions' prefills,
        at most ``max_tokens`` tokens (0: off; ``exact``: block-aligned feeds,
        ``specdec.model.prefix_cache``; ``CachedTreeDrafter.prefill_prefix``).
        A drafter without a model (n-gram) has nothing to keep."""

    def prefill(self, sid: str, tokens: list[int], features: torch.Tensor | None = None,
                greedy: bool = False, sampling: SamplingParams | None = None, cache_salt: str = "") -> None:
        """tokens: prompt + first generated token; features: [len(tokens) - 1, H]
        target hidden states at the prompt positions (EAGLE only); greedy: the
        session's verifier decodes at temperature 0; sampling: the session's
        sampling params (they set ``greedy``; None: top proposals only);
        cache_salt: prefix-cache blocks are shared between prefills of the same salt only."""
        if not tokens:
            raise InvalidArgument("drafter prefill needs at least one token")
        if self.needs_features and len(tokens) < 2:
            # its first input pairs a prompt token's feature with the token after it
            raise InvalidArgument(f"{self.name} drafter prefill needs at least 2 tokens (prompt + first "
                                  f"generated token), got {len(tokens)}")
        if sampling is not None:
            sampling.validate()
            greedy = sampling.greedy
        seed = sampling.seed if sampling is not None and sampling.seed is not None else \
            int.from_bytes(os.urandom(8), "little") >> 1
        sess = DraftSession(tokens=[], greedy=greedy, sampling=None if greedy else sampling, seed=seed)
        if sampling is not None and sampling.constraint is not None and self.grammar_tokenizer is not None:
            # tokens are the prompt and the first generated token (on a resume the
            # grammar fails to follow and the session drafts unmasked)
            try:
                sess.grammar = GrammarState(self.grammar_tokenizer, sampling.constraint, self.vocab_size, [],
                                            len(tokens) - 1)
            except Exception:  # noqa: BLE001 - the verifier refuses what does not compile
                sess.grammar = None
            self._follow_grammar(sess, tokens[-1:])
        self._append(sess, tokens, features, first=True)
        if self.prefix.on:
            self.prefill_prefix(sess, cache_salt)
        else:
            self.prefill_model(sess)
        self.sessions.add(sid, sess, replace=True)

    def commit(self, sid: str, tokens: list[int], features: torch.Tensor | None = None,
               token_ids: torch.Tensor | None = None) -> None:
        """tokens newly committed (accepted + bonus); features: [len(tokens), H];
        ``token_ids``: ``tokens`` on the device, where the verifier left them (in-process)."""
        sess = self.sessions.get(sid)
        with sess.lock:
            self._append(sess, tokens, features, first=False)
            if sess.fresh is not None and token_ids is not None and token_ids.shape == (len(tokens),):
                sess.fresh = (*sess.fresh[:2], on_device(token_ids, self.device))
            self._follow_grammar(sess, tokens)
            sess.record, sess.ahead = None, {}       # what was drafted ahead assumed other commits

    def rollback(self, sid: str, length: int) -> None:
        """Keep the first ``length`` committed tokens."""
        sess = self.sessions.get(sid)
        with sess.lock:
            if not 1 <= length <= len(sess.tokens):
                raise InvalidArgument(f"rollback length must be in [1, {len(sess.tokens)}], got {length}")
            del sess.tokens[length:]
            del sess.features[length - 1:]
            sess.state, sess.fresh = None, None
            sess.root_out = None
            sess.record, sess.ahead = None, {}
            if sess.grammar is not None:
                sess.grammar.truncate(length)
            if sess.cache is not None and sess.fed >= self._inputs_for(length):
                sess.fed = max(0, self._inputs_for(length) - 1)   # re-feed the root's input next draft
                kv.truncate(sess.cache, sess.fed)

    def release(self, sid: str) -> bool:
        return self.sessions.pop(sid) is not None

    @contextlib.contextmanager
    def locked(self, sids: list[str]):
        """The listed sessions that still exist, each once, held under their
        locks (taken in one order, so two batches never wait on each other)."""
        sessions = {}
        for sid in sids:
            try:
                sess = self.sessions.get(sid)
            except KeyError:
                continue                         # gone: left to fail when drafted
            sessions[id(sess.lock)] = sess
        held = [sessions[k] for k in sorted(sessions)]       # (``drafter.batch`` locks in this order too)
        with contextlib.ExitStack() as stack:
            for sess in held:
                stack.enter_context(sess.lock)
            yield held

    def draft(self, sid: str, cfg: TreeParams, ahead: bool = False, deferred: bool = False
              ) -> DraftTree | DeviceTree:
        """The session's tree; ``ahead``: keep what ``draft_ahead`` needs to draft
        the next round from it (model drafters only); ``deferred``: the tree may
        stay on the device, unread (``specdec.tree.placed.DeviceTree``: an
        in-process verifier reads it with its verdict)."""
        sess = self.sessions.get(sid)
        with sess.lock:
            sess.record, sess.ahead = None, {}
            if ahead:
                tree, sess.record = self._draft_recorded(sess, self.session_config(sess, cfg))
                return tree
            if deferred:
                return self._draft_deferred(sess, self.session_config(sess, cfg))
            return self.draft_session(sess, self.session_config(sess, cfg))

    def draft_ahead(self, sid: str, tokens: list[int], features: torch.Tensor | None, cfg: TreeParams,
                    count: int, tokens_left: int = 0, budget_s: float = 0.0) -> list[tuple[list[int], DraftTree]]:
        """Draft the next round while the verifier checks the session's current tree.

        The current tree is the last one ``draft(ahead=True)`` returned, or, when
        ``tokens`` (committed since, with their features) match one of the last
        call's outcomes, the tree drafted ahead for that outcome. ``tokens`` are
        committed first. Then, for each of the ``count`` likeliest outcomes of the
        current tree, the tree the next cycle would use if that outcome is what
        the verifier commits: drafted from the drafter's own outputs along the
        accepted path in place of the target's features (the session itself is
        left as it was). Returns [(the outcome's commit tokens, its tree)], none
        when the current tree is unknown. ``tokens_left``: tokens the request
        still wants before the current tree's outcome (0: no limit); no tree
        drafted ahead reaches past it. ``budget_s`` (0: no limit): the seconds
        the verify being hidden is expected to take; the paths are drafted
        likeliest first and none is started that would end past the budget
        (the first always is). Without a budget, which trees come back depends
        only on the tokens; with one, also on the drafter's speed (the output
        never does: a tree drafted ahead is used only for its exact outcome)."""
        sess = self.sessions.get(sid)
        with sess.lock:
            current = sess.ahead.get(tuple(int(t) for t in tokens)) if tokens else sess.record
            sess.record, sess.ahead = None, {}
            if tokens:
                self._append(sess, tokens, features, first=False)
                self._follow_grammar(sess, tokens)
            if sess.grammar is not None:        # trees drafted ahead would not follow the grammar
                return []
            if current is None or count <= 0 or int(current.tree.tokens[0]) != sess.tokens[-1]:
                return []
            return self._draft_ahead(sess, current, self.session_config(sess, cfg), count, tokens_left, budget_s)

    def session_config(self, sess: DraftSession, cfg: TreeParams) -> TreeParams:
        """``cfg`` with the value temperature this session drafts with and its
        proposals resolved to "top" or "sampled"."""
        if cfg.value_temperature is None:
            cfg = replace(cfg, value_temperature=self.greedy_value_temperature if sess.greedy else 1.0)
        sampled = cfg.proposals != "top" and self.samples_proposals and sess.sampling is not None
        want = "sampled" if sampled else "top"
        return cfg if cfg.proposals == want else replace(cfg, proposals=want)

    def proposal_sampler(self, sess: DraftSession, cfg: TreeParams, device: str | torch.device = "cpu"
                         ) -> ProposalSampler | None:
        """What draws this draft's children (``cfg`` from ``session_config``), its
        draws made on ``device``; None: top tokens."""
        if cfg.proposals != "sampled":
            return None
        return ProposalSampler(sess.sampling, sess.seed, salt=len(sess.tokens), device=device)

    @staticmethod
    def _follow_grammar(sess: DraftSession, tokens: list[int]) -> None:
        """Committed tokens into the session's matcher; one it cannot take (a
        resumed session's) ends masked drafting for the session."""
        if sess.grammar is not None:
            try:
                sess.grammar.commit(tokens)
            except Exception:  # noqa: BLE001 - drafts stay exact unmasked
                sess.grammar = None

    # -- for subclasses ----------------------------------------------------------
    @abstractmethod
    def draft_session(self, sess: DraftSession, cfg: TreeParams) -> DraftTree: ...

    def _draft_deferred(self, sess: DraftSession, cfg: TreeParams) -> DraftTree | DeviceTree:
        """``draft_session``, the tree left on the device where the drafter can (``draft``)."""
        return self.draft_session(sess, cfg)

    def _draft_recorded(self, sess: DraftSession, cfg: TreeParams) -> tuple[DraftTree, TreeRecord | None]:
        """``draft_session`` and its record for drafting ahead (None: this drafter cannot)."""
        return self.draft_session(sess, cfg), None

    def _draft_ahead(self, sess: DraftSession, current: TreeRecord, cfg: TreeParams, count: int,
                     tokens_left: int, budget_s: float = 0.0) -> list[tuple[list[int], DraftTree]]:
        return []

    def _inputs_for(self, n_tokens: int) -> int:
        """How many model inputs ``n_tokens`` committed tokens make."""
        return n_tokens

    def prefill_prefix(self, sess: DraftSession, salt: str) -> None:
        """With the prefix cache on: feed the prompt now, cached blocks loaded (model drafters)."""

    def prefill_model(self, sess: DraftSession) -> None:
        """With the prefix cache off: feed the prompt now (model drafters), so that
        a session's first draft feeds only what was committed since, as every later one."""

    def _append(self, sess: DraftSession, tokens: list[int], features, first: bool) -> None:
        bad = next((t for t in tokens if not 0 <= int(t) < self.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(f"token id {bad} is outside the drafter vocabulary [0, {self.vocab_size})")
        if self.needs_features:
            want = len(tokens) - 1 if first else len(tokens)
            if features is None or features.ndim != 2 or features.shape[0] != want:
                got = None if features is None else tuple(features.shape)
                raise InvalidArgument(f"EAGLE drafter needs features of shape [{want}, H], got {got}")
            features = features.float()
            sess.fresh = None if first else (len(sess.features), features, None)
            sess.features.extend(features.unbind(0))
        else:
            sess.fresh = None if first else (len(sess.tokens), None, None)
        sess.tokens.extend(int(t) for t in tokens)
