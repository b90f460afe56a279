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
import os
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from specdec.model import kv
from specdec.model import prefix_cache as pc
from specdec.request.errors import InvalidArgument
from specdec.request.params import SamplingParams, TreeParams
from specdec.serving.sessions import SessionTable
from specdec.tree.build import DraftTree, Frontier, build_tree_ids, subtree
from specdec.tree.proposals import ProposalSampler
from drafter.ahead import draft_forest, likely_stops, stop_scores


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


@dataclass(frozen=True)
class TreeRecord:
    """A drafted tree with its model's output at the nodes it expanded, kept so
    that the next round can be drafted from it while the verifier checks it."""

    tree: DraftTree
    hidden: torch.Tensor   # [n, H] model output at each node with children (row 0: the root); zeros elsewhere


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
    committed length, so a seed reproduces the tree."""

    needs_features = False
    name = "drafter"
    drafts_ahead = False                   # draft_ahead can return trees
    samples_proposals = False              # can draw sampled proposals

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
        self._append(sess, tokens, features, first=True)
        if self.prefix.on:
            self.prefill_prefix(sess, cache_salt)
        self.sessions.add(sid, sess, replace=True)

    def commit(self, sid: str, tokens: list[int], features: torch.Tensor | None = None) -> None:
        """tokens newly committed (accepted + bonus); features: [len(tokens), H]."""
        sess = self.sessions.get(sid)
        with sess.lock:
            self._append(sess, tokens, features, first=False)
            sess.record, sess.ahead = None, {}       # what was drafted ahead assumed other commits

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
            sess.record, sess.ahead = None, {}
            if sess.cache is not None and sess.fed >= self._inputs_for(length):
                sess.fed = max(0, self._inputs_for(length) - 1)   # re-feed the root's input next draft
                kv.truncate(sess.cache, sess.fed)

    def release(self, sid: str) -> bool:
        return self.sessions.pop(sid) is not None

    def draft(self, sid: str, cfg: TreeParams, ahead: bool = False) -> DraftTree:
        """The session's tree; ``ahead``: keep what ``draft_ahead`` needs to draft
        the next round from it (model drafters only)."""
        sess = self.sessions.get(sid)
        with sess.lock:
            sess.record, sess.ahead = None, {}
            if ahead:
                tree, sess.record = self._draft_recorded(sess, self.session_config(sess, cfg))
                return tree
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

    def proposal_sampler(self, sess: DraftSession, cfg: TreeParams) -> ProposalSampler | None:
        """What draws this draft's children (``cfg`` from ``session_config``); None: top tokens."""
        if cfg.proposals != "sampled":
            return None
        return ProposalSampler(sess.sampling, sess.seed, salt=len(sess.tokens))

    # -- for subclasses ----------------------------------------------------------
    @abstractmethod
    def draft_session(self, sess: DraftSession, cfg: TreeParams) -> DraftTree: ...

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

    drafts_ahead = True
    samples_proposals = True

    @abstractmethod
    def new_cache(self): ...

    @abstractmethod
    def feed_pending(self, sess: DraftSession, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed inputs [fed, end) into the cache (None: all of them); return (last hidden [H], log-probs [V])."""

    @abstractmethod
    def block_contents(self, sess: DraftSession, inputs: int):
        """The bytes of each whole block of the session's first ``inputs`` model
        inputs: what the model's K/V at those positions is a function of (the
        prefix cache's keys chain them)."""

    def fit_cache(self, cache, n: int) -> None:
        """Before ``n`` slots are loaded into ``cache``: room for them where its buffer has a fixed size."""

    def use_prefix_cache(self, max_tokens: int, exact: bool = False) -> None:
        self.prefix = pc.PrefixCache(max_tokens, exact=exact)

    @torch.inference_mode()
    def prefill_prefix(self, sess: DraftSession, salt: str) -> None:
        """Feed the prompt's inputs at prefill (``PrefixCache.spans``), the
        longest cached prefix of blocks loaded instead of computed; then
        the whole blocks not cached yet are added (copies: the session's later
        drafts and rollbacks never reach them). At least the last input is fed
        (its output roots the first draft)."""
        block, inputs = self.prefix.block, self._inputs_for(len(sess.tokens))
        root = pc.namespace("drafter", self.name, type(self).__name__, self.vocab_size, salt, block)
        keys = pc.chain(root, self.block_contents(sess, inputs))
        found = self.prefix.match(keys, pc.usable(inputs, block))
        sess.cache = self.new_cache()
        if found:
            self.fit_cache(sess.cache, len(found) * block)
            kv.append_blocks(sess.cache, found)
            sess.fed = len(found) * block
        for _, end in self.prefix.spans(sess.fed, inputs):
            sess.root_out = self.feed_pending(sess, end)

        def payload(j: int):
            slots = kv.copy_slots(sess.cache, j * block, (j + 1) * block)
            return slots, kv.slots_nbytes(slots)

        self.prefix.insert(keys, payload)

    @abstractmethod
    def step(self, sess: DraftSession, tokens: torch.Tensor, parent_hidden: torch.Tensor,
              positions: torch.Tensor, allowed: torch.Tensor,
              key_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One tree level: tokens [k], parent_hidden [k, H], positions [k]; allowed
        [k, cache + k] bool (which slots each node sees), key_positions [cache + k]
        (the position of the token in each slot). Returns hidden [k, H], log-probs [k, V]."""

    def draft_whole(self, cache, root_token: int, root_hidden: torch.Tensor, root_logp: torch.Tensor,
                    cfg: TreeParams) -> tuple[DraftTree, torch.Tensor] | None:
        """A top-proposal draft of ``cfg`` after the root in one call (the tree and
        its nodes' outputs [n, H] fp32, as the level-by-level path records them),
        or None: draft it level by level."""
        return None

    def draft_session(self, sess: DraftSession, cfg: TreeParams) -> DraftTree:
        return self._build(sess, cfg, record=False)[0]

    def _draft_recorded(self, sess: DraftSession, cfg: TreeParams) -> tuple[DraftTree, TreeRecord | None]:
        return self._build(sess, cfg, record=True)

    @torch.inference_mode()
    def _draft_ahead(self, sess: DraftSession, current: TreeRecord, cfg: TreeParams, count: int,
                     tokens_left: int, budget_s: float = 0.0) -> list[tuple[list[int], DraftTree]]:
        """For each likely accepted path (likeliest first, while the budget lasts):
        a tree rooted at its last node, one level deeper and twice the size,
        whose first level holds candidates for the bonus token (never a child
        the current tree already had there: the verifier would have accepted
        it); under each candidate b, the subtree is the tree for the outcome
        (path, b)."""
        start = time.perf_counter()
        if sess.cache is None:
            sess.cache = self.new_cache()
        if sess.fed < self._inputs_for(len(sess.tokens)) or sess.root_out is None:
            sess.root_out = self.feed_pending(sess)     # the real commit stays fed
        if cfg.method == "eagle2":
            return self._draft_forest(sess, current, cfg, count, tokens_left, budget_s)
        root_hidden = sess.root_out[0]
        kids = current.tree.children()
        out = []
        for drafted, path in enumerate(likely_stops(current.tree, count)):
            spent = time.perf_counter() - start
            if drafted and budget_s and spent + spent / drafted > budget_s:
                break                   # the next path would end after the verify it hides behind
            accepted = current.tree.tokens[path[1:]].tolist()
            left = tokens_left - len(accepted) - 1 if tokens_left else 0   # wanted after (path, bonus)
            if tokens_left and left <= 1:
                continue
            depth = cfg.depth if not tokens_left else min(cfg.depth, left - 1)
            big = replace(cfg, depth=depth + 1, total_tokens=2 * cfg.total_tokens)
            # the target's features along the path, as the drafter predicted them
            feats = (torch.stack([root_hidden, *current.hidden[path[1:-1]]]) if self.needs_features and accepted
                     else None)
            taken = current.tree.tokens[kids[path[-1]]].tolist()
            tree, rec = self._on_outcome(sess, accepted, feats, big, taken)
            for child in tree.children()[0]:
                sub, keep = subtree(tree, child, cfg.total_tokens)
                sub_rec = TreeRecord(sub, rec.hidden[keep])
                commit = accepted + [int(tree.tokens[child])]
                sess.ahead[tuple(commit)] = sub_rec
                out.append((commit, sub))
        return out

    def _draft_forest(self, sess: DraftSession, current: TreeRecord, cfg: TreeParams, count: int,
                      tokens_left: int, budget_s: float) -> list[tuple[list[int], DraftTree]]:
        """EAGLE-2 trees drafted ahead together (``drafter.ahead``) for the likeliest
        accepted paths: ``count`` of them, fewer when the last forest's time per
        path says more would not fit in ``budget_s``."""
        if budget_s and sess.ahead_s_per_end:
            count = max(1, min(count, int(budget_s / sess.ahead_s_per_end)))
        scores = stop_scores(current.tree)
        ends = []
        for node in torch.sort(scores, descending=True, stable=True).indices.tolist():
            if len(ends) == count:
                break
            left = tokens_left - int(current.tree.depths[node]) - 1 if tokens_left else 0   # after the bonus
            if tokens_left and left <= 1:
                continue
            ends.append((node, float(scores[node]), cfg.depth if not tokens_left else min(cfg.depth, left - 1)))
        if not ends:
            return []
        start, committed = time.perf_counter(), kv.seq_len(sess.cache)
        try:
            outcomes = draft_forest(lambda *args: self.step(sess, *args), current.tree, current.hidden, sess.root_out,
                                    committed, ends, cfg.total_tokens, cfg.expand_k, cfg.value_temperature or 1.0)
        finally:
            kv.truncate(sess.cache, committed)
        sess.ahead_s_per_end = (time.perf_counter() - start) / len(ends)
        for o in outcomes:
            sess.ahead[tuple(o.commit)] = TreeRecord(o.tree, o.hidden)
        return [(o.commit, o.tree) for o in outcomes]

    def _on_outcome(self, sess: DraftSession, accepted: list[int], feats, cfg: TreeParams, exclude: list[int]):
        """Draft (recorded) as if ``accepted`` had been committed, with ``exclude``
        kept off the first level; then put the session back."""
        n_tokens, n_feats, fed, root_out = len(sess.tokens), len(sess.features), sess.fed, sess.root_out
        try:
            if accepted:
                self._append(sess, accepted, feats, first=False)
            return self._build(sess, cfg, record=True, exclude=exclude)
        finally:
            del sess.tokens[n_tokens:]
            del sess.features[n_feats:]
            kv.truncate(sess.cache, fed)
            sess.fed, sess.root_out = fed, root_out

    @torch.inference_mode()
    def _build(self, sess: DraftSession, cfg: TreeParams, record: bool,
               exclude: list[int] | None = None) -> tuple[DraftTree, TreeRecord | None]:
        """The tree (and its record); ``exclude``: tokens kept off the first level
        (the others' log-probs renormalised)."""
        if sess.cache is None:
            sess.cache = self.new_cache()
        if sess.fed < self._inputs_for(len(sess.tokens)) or sess.root_out is None:
            sess.root_out = self.feed_pending(sess)
        root_hidden, root_logp = sess.root_out    # a second draft with nothing new reuses it
        if exclude:
            root_logp = root_logp.clone()
            root_logp[exclude] = -math.inf
            root_logp = root_logp - torch.logsumexp(root_logp, dim=-1)
        committed = kv.seq_len(sess.cache)
        root_pos = committed - 1
        hidden = {0: root_hidden}          # pool id -> model output at that node
        slot: dict[int, int] = {}          # pool id -> draft KV slot (0-based after `committed`)
        parent_of: dict[int, int] = {0: -1}

        slot_pos = torch.arange(committed)   # position of the token in each cache slot

        def expand(frontier: Frontier) -> torch.Tensor:
            nonlocal slot_pos
            if frontier.depth == 0:
                return root_logp[None]
            nodes, parents = frontier.nodes.tolist(), frontier.parents.tolist()
            k, used = len(nodes), len(slot)
            allowed = torch.zeros(k, committed + used + k, dtype=torch.bool)
            allowed[:, :committed] = True
            rows, cols = [], []            # the draft slots each node sees: its ancestors' and its own
            for row, (node, parent) in enumerate(zip(nodes, parents)):
                parent_of[node] = parent
                a = parent
                while a > 0:               # the root's input is committed, not a draft slot
                    rows.append(row)
                    cols.append(committed + slot[a])
                    a = parent_of[a]
                rows.append(row)
                cols.append(committed + used + row)
            allowed[rows, cols] = True
            positions = torch.full((k,), root_pos + frontier.depth, dtype=torch.long)
            slot_pos = torch.cat([slot_pos, positions])
            parent_h = torch.stack([hidden[p] for p in parents])
            out_h, logp = self.step(sess, frontier.tokens, parent_h, positions, allowed, slot_pos)
            for row, node in enumerate(nodes):
                slot[node] = used + row
                hidden[node] = out_h[row]
            return logp

        try:
            whole = None if exclude or cfg.proposals == "sampled" else \
                self.draft_whole(sess.cache, sess.tokens[-1], root_hidden, root_logp, cfg)
            if whole is not None:            # the whole draft in one graph (drafter.compiled.whole_draft)
                return whole[0], TreeRecord(whole[0], whole[1]) if record else None
            tree, ids = build_tree_ids(sess.tokens[-1], expand, cfg, self.proposal_sampler(sess, cfg))
            if not record:
                return tree, None
            # a path the verifier may accept feeds the outputs of its nodes that have
            # children: those were all expanded
            none = torch.zeros_like(root_hidden)
            rec = TreeRecord(tree, torch.stack([hidden.get(n, none) for n in ids.tolist()]).float().cpu())
            return tree, rec
        finally:
            kv.truncate(sess.cache, committed)
