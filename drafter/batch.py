"""Batched drafting: concurrent sessions' tree expansions share one model forward per level.

``draft_batch(drafter, items)`` commits and drafts several sessions at once.
For a model drafter (EAGLE head or draft LM) every model step becomes one
forward over all of them, as ``verifier.batch`` does for verification:

* Feed. The sessions' prefixes are copied into a padded batch cache
  [B, kv_heads, P, d] (P = longest prefix; row b's slots past its own prefix p_b
  are masked) and their pending committed inputs, padded to M, run as one
  forward: input i of row b sees slots [0, p_b) and [P, P + i]. Each session
  then takes its new slots [P, P + m_b) back into its own cache, exactly the
  committed inputs a solo draft would have fed.
* Tree levels. ``specdec.tree.build.build_tree`` stays untouched: each session's
  tree is built on its own thread, whose ``expand`` hands its frontier to the
  coordinator (the calling thread) and blocks. When every session still
  building has handed in a frontier or finished, the coordinator pads the
  frontiers to K nodes, appends them to the batch cache as slots [L, L + K)
  and runs one forward in which node i of row b sees its session's committed
  slots, its own tree ancestors and itself; every session then gets its rows.
  Trees of different methods, sizes and depths simply drop out when done (the
  batch cache is compacted to the rows still building). Padding query rows see
  only themselves, so no softmax row is empty.

Draft-only slots live in the batch cache alone, which is dropped afterwards:
a session's own cache only ever gains committed inputs, as with
``CachedTreeDrafter.draft_session``. Each session's tree is the one it gets drafted
alone (same tokens and parents; values equal up to float rounding, since a
padded forward may sum in another order).

Which drafters batch: the ones whose model this module knows how to run over
a batch cache (the feature heads, EAGLE-1/2 and EAGLE-3, and ``DraftLmDrafter``,
with their own step and feed; a head's token embedding and log-probs are its
drafter's, called as they are); anything else, the n-gram drafter included,
drafts one by one; Medusa heads (``drafter.medusa``) run one heads forward
for all the batch's sessions, then build the trees one by one, and so do
Hydra heads (``drafter.hydra``) for their first level (the prefix layer's
feed and head 0: nothing of a tree yet), their deeper levels reading each
session's own paths. So does a drafter whose steps are compiled (``--compile``:
``drafter.compiled.head_levels``, a compiled draft LM): one batched forward per
level would run eagerly, and the compiled steps one session after another
took half its time (the demo EAGLE head, 2, 4 and 8 sessions of 128 tokens
drafting default trees: 4.3 / 8.7 / 16.5 ms against 8.4 / 16.2 / 33.1 ms). A
bad item (unknown session, bad token, bad features) fails alone.

``DraftScheduler`` collects concurrent Draft calls for at most a few ms and
hands them to ``draft_batch`` (``specdec.serving.batching``, shared with the verifier).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from specdec.model import kv, masks
from specdec.request.errors import FailedPrecondition
from specdec.request.params import TreeParams
from specdec.serving.batching import BatchScheduler
from specdec.tree.build import DraftTree, Frontier, build_tree, tree_from_lists
from specdec.tree.grammar import masked_expand
from specdec.tree.placed import DeviceTree
from drafter.base import Drafter, DraftSession
from drafter.cached import CachedTreeDrafter
from drafter.draft_lm import DraftLmDrafter
from drafter.eagle.eagle2 import FeatureHeadDrafter
from drafter.hydra import HydraDrafter
from drafter.medusa import MedusaDrafter

# (session id, tokens to commit first (may be empty), their features [n, H] or None,
#  tree config or None = VANILLA: no drafting, the tree is the root alone)
DraftItem = tuple[str, list[int], "torch.Tensor | None", "TreeParams | None"]

_FEED_ROOM = 64           # batch-cache slots kept for the inputs fed before the tree levels


# -- how a batch cache is run through each known model ----------------------------------------------
class _FeatureHeadModel:
    """A FeatureHeadDrafter (EAGLE-1/2, EAGLE-3): input t is (f_t, x_{t+1}); a
    tree node's feature is its parent's output."""

    uses_features = True

    def __init__(self, drafter):
        self.d, self.device = drafter, drafter.device

    def pending(self, sess: DraftSession) -> tuple[list[int], torch.Tensor | None, int]:
        start, end = sess.fed, len(sess.tokens) - 1
        feats = torch.stack(sess.features[start:end]) if end > start else None
        return sess.tokens[start + 1:end + 1], feats, start

    def masks(self, allowed, q_pos, k_pos) -> torch.Tensor:
        """The head is one full-attention layer: the additive mask [B, 1, q, k]."""
        return masks.additive(allowed, self.d.head.fc.weight.dtype)[:, None].to(self.device)

    def forward(self, tokens, feats, positions, mask, cache) -> torch.Tensor:
        return self.d.head(self.d.embed_tokens(tokens), feats, positions, mask, cache)

    def new_cache(self):
        """An eager cache for a batch (a compiled head's session caches are one-row stacked buffers)."""
        return kv.new_cache(self.d.head.config)

    def fit(self, cache, n: int) -> None:
        """Before n slots are appended to a session's cache: a compiled head's buffer has one fixed size."""

    def logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.d.logprobs(hidden)


class _LmModel:
    """DraftLmDrafter: input t is token t; no features."""

    uses_features = False

    def __init__(self, drafter):
        self.d, self.device = drafter, drafter.lm.device

    def pending(self, sess: DraftSession) -> tuple[list[int], torch.Tensor | None, int]:
        return sess.tokens[sess.fed:], None, sess.fed

    def masks(self, allowed, q_pos, k_pos):
        return self.d.lm.masks(allowed, q_pos, k_pos)          # windows and per-layer masks included

    def forward(self, tokens, feats, positions, mask, cache) -> torch.Tensor:
        return self.d.lm.hidden(cache, tokens, positions, mask)

    def new_cache(self):
        """An eager cache for a batch (compiled session caches are one-row stacked buffers)."""
        return self.d.lm.new_cache()

    def fit(self, cache, n: int) -> None:
        """Before n slots are appended to a session's cache: a compiled one moves up a capacity bucket if needed."""
        if self.d.compiled is not None:
            self.d.compiled.fit(cache, n)

    def logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.d.logprobs(hidden)


def _model_for(drafter: Drafter):
    """The batched runner for ``drafter``, or None when it must draft one by one.
    A subclass that changes how a step or a feed runs is not batched: the
    batched forward could not reproduce it (how it embeds tokens and reads
    log-probs it may change: the runner calls those). A drafter with compiled
    steps drafts one by one too: they beat one eager batched forward (the
    demo EAGLE head, 2 to 8 sessions: half the time; module doc)."""
    if getattr(drafter, "compiled", None) is not None:
        return None
    if not isinstance(drafter, CachedTreeDrafter) or type(drafter).draft_session is not CachedTreeDrafter.draft_session:
        return None
    for base, runner in ((FeatureHeadDrafter, _FeatureHeadModel), (DraftLmDrafter, _LmModel)):
        cls = type(drafter)
        if isinstance(drafter, base) and all(getattr(cls, name) is getattr(base, name)
                                             for name in ("step", "feed_pending", "_run", "_inputs_for")
                                             if hasattr(base, name)):
            return runner(drafter)
    return None


# -- one session in a batch -------------------------------------------------------------------------
@dataclass(eq=False)
class _Level:
    """A frontier handed in by a session's tree builder."""

    tokens: torch.Tensor                 # [k]
    parent_hidden: torch.Tensor          # [k, H] model output at each node's parent
    position: int                        # position of every node of the level
    ancestors: list[list[int]]           # per node: batch-cache slots of its draft ancestors


@dataclass(eq=False)                     # rows are compared by identity
class _Row:
    item: int
    sess: DraftSession
    cfg: TreeParams
    prefix: int = 0                      # slots already in the session's cache
    fed: int = 0                         # inputs fed by this batch (batch slots [P, P + fed))
    root_pos: int = 0
    hidden: dict = field(default_factory=dict)     # pool id -> model output at that node
    slot: dict = field(default_factory=dict)       # pool id -> its batch-cache slot
    parent_of: dict = field(default_factory=lambda: {0: -1})
    request: _Level | None = None
    reply: object = None                 # (hidden [k, H], log-probs [k, V], slots) or an exception
    done: bool = False
    tree: DraftTree | None = None
    error: Exception | None = None
    sampler: object = None               # ProposalSampler of a sampled tree


def draft_batch(drafter: Drafter, items: list[DraftItem]) -> list[DraftTree | Exception]:
    """Commit, then draft, each item; one tree or error per item, in order.
    A session may appear at most once per batch."""
    results: list[DraftTree | Exception] = [None] * len(items)  # type: ignore[list-item]
    todo: list[tuple[int, str, TreeParams]] = []
    seen: set[str] = set()
    for i, (sid, tokens, feats, cfg) in enumerate(items):
        try:
            if sid in seen:
                raise FailedPrecondition(f"session {sid!r} appears twice in one batch")
            seen.add(sid)
            if tokens:
                drafter.commit(sid, list(tokens), feats)
            if cfg is None:
                results[i] = tree_from_lists([drafter.sessions.get(sid).tokens[-1]], [-1])
            else:
                todo.append((i, sid, cfg))
        except Exception as exc:  # noqa: BLE001 - reported per item
            results[i] = exc
    model = _model_for(drafter) if len(todo) > 1 else None
    if isinstance(drafter, (MedusaDrafter, HydraDrafter)) and len(todo) > 1:
        drafter.prepare([sid for _, sid, _ in todo])      # the first level in one forward (Medusa: all of it)
    if model is None:                    # nothing to share a forward with
        unread = []
        for i, sid, cfg in todo:
            try:
                results[i] = drafter.draft(sid, cfg, deferred=True)
                if isinstance(results[i], DeviceTree):
                    unread.append(i)
            except Exception as exc:  # noqa: BLE001
                results[i] = exc
        _read_together(results, unread)
        return results

    rows: list[_Row] = []
    for i, sid, cfg in todo:
        try:
            sess = drafter.sessions.get(sid)
            sess.record, sess.ahead = None, {}      # a batched tree is not kept for drafting ahead
            rows.append(_Row(i, sess, drafter.session_config(sess, cfg)))
        except Exception as exc:  # noqa: BLE001
            results[i] = exc
    locks = sorted({id(r.sess.lock): r.sess.lock for r in rows}.items())
    for _, lock in locks:
        lock.acquire()
    try:
        _draft_rows(drafter, model, rows)
    finally:
        for _, lock in locks:
            lock.release()
    for row in rows:
        results[row.item] = row.tree if row.error is None else row.error
    return results


def _read_together(results: list, unread: list[int]) -> None:
    """The trees left on the device (``DeviceTree``s at ``unread``), read in one
    read: a batch of drafts costs what one draft does; a flagged one is
    drafted again level by level (its reader's fallback)."""
    if not unread:
        return
    values = torch.cat([results[i].read for i in unread]).tolist()               # the batch's one read
    at = 0
    for i in unread:
        tree, size = results[i], results[i].read.shape[0]
        try:
            results[i] = tree.resolve(values[at:at + size]) or tree.materialize()
        except Exception as exc:  # noqa: BLE001 - reported per item
            results[i] = exc
        at += size


@torch.inference_mode()
def _draft_rows(drafter: CachedTreeDrafter, model, rows: list[_Row]) -> None:
    """Draft every row, sharing each forward; sets row.tree or row.error."""
    feeds: list[tuple[_Row, list[int], torch.Tensor | None, int]] = []
    for row in rows:
        try:
            sess = row.sess
            if sess.cache is None:
                sess.cache = drafter.new_cache()
            tokens, feats, start = model.pending(sess)
            if not tokens and sess.root_out is None:
                # nothing to feed yet no root output (e.g. an EAGLE session of one
                # token): the solo path decides what that means
                row.tree = drafter.draft_session(sess, row.cfg)
                row.done = True
                continue
            row.prefix = kv.seq_len(sess.cache)
            row.sampler = drafter.proposal_sampler(sess, row.cfg)
            feeds.append((row, tokens, feats, start))
        except Exception as exc:  # noqa: BLE001 - reported per item
            row.error, row.done = exc, True
    live = [row for row, *_ in feeds]
    if not live:
        return
    try:
        batch = _Batch(drafter, model, live)
        batch.feed(feeds)
    except Exception as exc:  # noqa: BLE001 - an unexpected failure fails every row of the forward
        for row in live:
            row.error, row.done = exc, True
        return
    _Levels(batch, live).run()


class _Batch:
    """The padded batch cache and the forwards over it.

    Slots [0, P) hold each row's old prefix (row b: [0, prefix_b) real, the rest
    padding), [P, P + M) the inputs fed now (row b: [P, P + fed_b)); tree levels
    append after that. ``rows[b]`` is the session in batch row b."""

    def __init__(self, drafter: CachedTreeDrafter, model, rows: list[_Row]):
        self.model, self.rows = model, list(rows)
        self.P = max(r.prefix for r in rows)
        self.cache = model.new_cache()
        # the position of the token in each batch slot [B, L]: a prefix's slot i holds position i
        self.key_positions = torch.arange(self.P).expand(len(rows), self.P)
        # room past the prefixes for the inputs fed now and the tree levels: they are written in place
        room = _FEED_ROOM + max(r.cfg.depth * r.cfg.expand_k for r in rows)
        kv.gather_rows(self.cache, [r.sess.cache for r in rows], [r.prefix for r in rows], self.P, room)

    def _committed(self, row: _Row, length: int) -> torch.Tensor:
        """bool [length]: the batch-cache slots holding ``row``'s committed inputs."""
        slots = torch.arange(length)
        return (slots < row.prefix) | ((slots >= self.P) & (slots < self.P + row.fed))

    def _forward(self, tokens, feats, positions, allowed):
        """One forward of tokens [B, n] at positions [B, n] appended to the batch cache."""
        self.key_positions = torch.cat([self.key_positions, positions], dim=1)
        mask = self.model.masks(allowed, positions, self.key_positions)
        dev = self.model.device
        return self.model.forward(tokens.to(dev), None if feats is None else feats.to(dev), positions.to(dev),
                                  mask, self.cache)

    def feed(self, feeds: list[tuple[_Row, list[int], torch.Tensor | None, int]]) -> None:
        """Feed every row's pending committed inputs in one forward, give each
        session its new slots and root output."""
        B, P = len(feeds), self.P
        M = max(len(tokens) for _, tokens, _, _ in feeds)
        for row, *_ in feeds:
            row.root_pos = row.prefix - 1
        if M == 0:                       # every root output is still valid: nothing to run
            for row, *_ in feeds:
                row.hidden[0] = row.sess.root_out[0]
            return
        tokens = torch.zeros(B, M, dtype=torch.long)
        positions = torch.zeros(B, M, dtype=torch.long)
        allowed = torch.zeros(B, M, P + M, dtype=torch.bool)
        ref = next(f for _, _, f, _ in feeds if f is not None) if self.model.uses_features else None
        feats = None if ref is None else ref.new_zeros(B, M, ref.shape[-1])
        causal = torch.ones(M, M, dtype=torch.bool).tril()
        for b, (row, toks, f, start) in enumerate(feeds):
            m = len(toks)
            tokens[b, :m] = torch.tensor(toks, dtype=torch.long)
            positions[b, :m] = torch.arange(start, start + m)
            allowed[b, :m, :row.prefix] = True
            allowed[b, :m, P:P + m] = causal[:m, :m]
            pad = torch.arange(m, M)
            allowed[b, pad, P + pad] = True            # padding rows: themselves only
            if feats is not None and m:
                feats[b, :m] = f
        hidden = self._forward(tokens, feats, positions, allowed)        # [B, M, H]
        fed = [(b, row, len(toks)) for b, (row, toks, _, _) in enumerate(feeds) if toks]
        last = hidden[[b for b, _, _ in fed], [m - 1 for _, _, m in fed]]   # [b', H]
        logp = self.model.logprobs(last)
        for j, (b, row, m) in enumerate(fed):
            self.model.fit(row.sess.cache, m)
            kv.append_slots(row.sess.cache, self.cache, b, torch.arange(P, P + m, device=self.model.device))
            row.sess.fed += m
            # copies: a view would keep the whole batch output alive with the session
            row.sess.root_out = (last[j].clone(), logp[j].clone())
            row.fed, row.root_pos = m, row.prefix + m - 1
        for row, *_ in feeds:
            row.hidden[0] = row.sess.root_out[0]

    def step(self, rows: list[_Row], levels: list[_Level]) -> list[tuple]:
        """One tree level of every row in one forward -> per row (hidden [k, H],
        log-probs [k, V], the batch-cache slots of its nodes)."""
        if rows != self.rows:            # some trees are done: drop their batch rows
            where = {id(r): b for b, r in enumerate(self.rows)}
            keep = torch.tensor([where[id(r)] for r in rows], device=self.cache.layers[0].keys.device)
            kv.select_rows(self.cache, keep)
            self.key_positions = self.key_positions[keep.cpu()]
            self.rows = list(rows)
        B, L = len(rows), kv.seq_len(self.cache)
        sizes = [len(level.tokens) for level in levels]
        K = max(sizes)
        tokens = torch.zeros(B, K, dtype=torch.long)
        positions = torch.zeros(B, K, dtype=torch.long)
        allowed = torch.zeros(B, K, L + K, dtype=torch.bool)
        ref = levels[0].parent_hidden
        feats = ref.new_zeros(B, K, ref.shape[-1]) if self.model.uses_features else None
        for b, (row, level, k) in enumerate(zip(rows, levels, sizes)):
            tokens[b, :k] = level.tokens
            positions[b, :k] = level.position
            allowed[b, :k, :L] = self._committed(row, L)
            for i, ancestors in enumerate(level.ancestors):
                if ancestors:
                    allowed[b, i, ancestors] = True
            if feats is not None:
                feats[b, :k] = level.parent_hidden
        idx = torch.arange(K)
        allowed[:, idx, L + idx] = True                    # itself (all that padding rows see)
        hidden = self._forward(tokens, feats, positions, allowed)        # [B, K, H]
        real = torch.arange(K)[None] < torch.tensor(sizes)[:, None]        # [B, K]
        logp = self.model.logprobs(hidden[real.to(hidden.device)]).split(sizes)
        return [(hidden[b, :k], logp[b], list(range(L, L + k))) for b, k in enumerate(sizes)]


class _Levels:
    """Runs each row's ``build_tree`` on its own thread and every level of all
    of them as one ``_Batch.step`` on the calling thread."""

    def __init__(self, batch: _Batch, rows: list[_Row]):
        self.batch, self.rows = batch, rows
        self.cond = threading.Condition()
        self.abort: BaseException | None = None   # the coordinator died: builders stop waiting

    def run(self) -> None:
        threads = [threading.Thread(target=self._build, args=(row,), name=f"draft-batch-{n}", daemon=True)
                   for n, row in enumerate(self.rows)]
        for t in threads:
            t.start()
        try:
            self._serve()
        except BaseException as exc:
            with self.cond:
                self.abort = exc
                self.cond.notify_all()
            raise
        finally:
            for t in threads:
                t.join()

    def _serve(self) -> None:
        while True:
            with self.cond:
                # every session still building has handed in its next level
                self.cond.wait_for(lambda: all(r.done or r.request is not None for r in self.rows))
                asking = [r for r in self.rows if not r.done]
                if not asking:
                    return
                levels = [r.request for r in asking]
                for r in asking:
                    r.request = None
            try:
                replies = self.batch.step(asking, levels)
            except Exception as exc:  # noqa: BLE001 - fails the rows of this forward, in their threads
                replies = [exc] * len(asking)
            with self.cond:
                for r, reply in zip(asking, replies):
                    r.reply = reply
                self.cond.notify_all()

    def _build(self, row: _Row) -> None:
        try:
            with torch.inference_mode():           # thread-local: enter it on this thread too
                expand = lambda frontier: self._expand(row, frontier)   # noqa: E731
                if row.sess.grammar is not None:    # a constrained session: masked along each node's path
                    expand = masked_expand(expand, row.sess.grammar)
                row.tree = build_tree(row.sess.tokens[-1], expand, row.cfg, row.sampler)
        except Exception as exc:  # noqa: BLE001 - reported per item
            row.error = exc
        finally:
            with self.cond:
                row.done = True
                self.cond.notify_all()

    def _expand(self, row: _Row, frontier: Frontier) -> torch.Tensor:
        """As CachedTreeDrafter.draft_session's expand, with the model step done by the coordinator."""
        if frontier.depth == 0:
            return row.sess.root_out[1][None]
        nodes, parents = frontier.nodes.tolist(), frontier.parents.tolist()
        ancestors = []
        for node, parent in zip(nodes, parents):
            row.parent_of[node] = parent
            seen, a = [], parent
            while a > 0:                   # the root's input is committed, not a draft slot
                seen.append(row.slot[a])
                a = row.parent_of[a]
            ancestors.append(seen)
        level = _Level(frontier.tokens, torch.stack([row.hidden[p] for p in parents]),
                       row.root_pos + frontier.depth, ancestors)
        with self.cond:
            row.request = level
            self.cond.notify_all()
            self.cond.wait_for(lambda: row.reply is not None or self.abort is not None)
            reply, row.reply = (row.reply if row.reply is not None else self.abort), None
        if isinstance(reply, BaseException):
            raise reply
        out_h, logp, slots = reply
        for node, h, s in zip(nodes, out_h, slots):
            row.hidden[node], row.slot[node] = h, s
        return logp


# -- collecting concurrent calls ----------------------------------------------------------------------
class DraftScheduler(BatchScheduler):
    """Concurrent Draft calls run as one ``draft_batch`` (``specdec.serving.batching``:
    a lone session never waits); ``runner(items)`` runs ``draft_batch(drafter,
    items)`` where the model lives."""

    async def draft(self, sid: str, tokens: list[int], features: torch.Tensor | None,
                    cfg: TreeParams | None) -> tuple[DraftTree, float]:
        """(tree, seconds of the batched step it was part of)."""
        return await self.submit((sid, tokens, features, cfg))
