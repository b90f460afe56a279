"""The KV-cached tree expansion shared by model drafters (an EAGLE head, a small
LM): a session's model has consumed a prefix of its committed tokens
(``fed``); the rest are fed at the start of the next draft, whose last output
roots the tree. Expansion appends draft-only KV slots, each visible to its
tree descendants only, and drops them when the tree is built, so the cache
never holds a token that was not committed. Drafting ahead (``drafter.ahead``)
and prompt prefixes kept across sessions (``specdec.model.prefix_cache``) live
here too.
"""

from __future__ import annotations

import math
import time
from abc import abstractmethod
from dataclasses import replace

import torch

from specdec.compile.forwards import width_bucket
from specdec.model import kv
from specdec.model import prefix_cache as pc
from specdec.request.errors import FailedPrecondition
from specdec.request.params import TreeParams
from specdec.tree import drawn, ranked
from specdec.tree.build import DraftTree, Frontier, build_tree_ids, subtree
from specdec.tree.grammar import masked_expand
from specdec.tree.placed import DeviceTree, PlacedTree, tree_of_read
from drafter.ahead import draft_forest, likely_stops, stop_scores

from drafter.base import Drafter, DraftSession, TreeRecord


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
    def prefill_model(self, sess: DraftSession) -> None:
        sess.cache = self.new_cache()
        if sess.fed < self._inputs_for(len(sess.tokens)):      # (a one-token prompt has no input yet)
            sess.root_out = self.feed_pending(sess)

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

    def level_step(self, sess: DraftSession, tokens: torch.Tensor, parent_hidden: torch.Tensor,
                   positions: torch.Tensor, allowed: torch.Tensor,
                   key_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``step`` with every input on the model's device already (a tree drafted
        there, ``specdec.tree.drawn``); a model that can, copies nothing up."""
        return self.step(sess, tokens, parent_hidden, positions, allowed, key_positions)

    def draft_whole(self, cache, root_token: int, root_hidden: torch.Tensor, root_logp: torch.Tensor,
                    cfg: TreeParams, fallback=None) -> tuple[DraftTree | DeviceTree, torch.Tensor] | None:
        """A top-proposal draft of ``cfg`` after the root in one call (the tree and
        its nodes' outputs [n, H] fp32, as the level-by-level path records them),
        or None: draft it level by level. With ``fallback`` (that level-by-level
        draft, a callable) the tree may stay on the device, unread (``DeviceTree``)."""
        return None

    def draft_session(self, sess: DraftSession, cfg: TreeParams) -> DraftTree:
        return self._build(sess, cfg, record=False)[0]

    def _draft_deferred(self, sess: DraftSession, cfg: TreeParams) -> DraftTree | DeviceTree:
        def level_by_level() -> DraftTree:          # what the tree's reader takes where the graph flagged it
            with sess.lock:
                if sess.tokens[-1] != root:
                    raise FailedPrecondition("the session moved on before its tree drafted on the device was read")
                return self._build(sess, cfg, record=False, graph=False)[0]

        root = sess.tokens[-1]
        return self._build(sess, cfg, record=False, fallback=level_by_level)[0]

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
        depths, by_score = current.tree.lists[2], scores.tolist()
        ends = []
        for node in torch.sort(scores, descending=True, stable=True).indices.tolist():
            if len(ends) == count:
                break
            left = tokens_left - depths[node] - 1 if tokens_left else 0   # after the bonus
            if tokens_left and left <= 1:
                continue
            ends.append((node, by_score[node], cfg.depth if not tokens_left else min(cfg.depth, left - 1)))
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
        n_tokens, n_feats, fed, root_out, fresh = (len(sess.tokens), len(sess.features), sess.fed, sess.root_out,
                                                   sess.fresh)
        try:
            if accepted:
                self._append(sess, accepted, feats, first=False)
            return self._build(sess, cfg, record=True, exclude=exclude)
        finally:
            del sess.tokens[n_tokens:]
            del sess.features[n_feats:]
            kv.truncate(sess.cache, fed)
            sess.fed, sess.root_out, sess.fresh = fed, root_out, fresh

    def _levels_on_device(self, sess: DraftSession, committed: int):
        """The level function a tree drafted on the device calls (``specdec.tree.drawn.LevelFn``):
        ``level_step`` after ``committed`` cached slots, the key positions kept on the device."""
        key_positions = torch.arange(committed, device=sess.root_out[1].device)

        def level(tokens, parent_hidden, positions, allowed):
            nonlocal key_positions
            key_positions = torch.cat([key_positions, positions])
            return self.level_step(sess, tokens, parent_hidden, positions, allowed, key_positions)

        return level

    def _draft_drawn(self, sess: DraftSession, cfg: TreeParams, sampler, committed: int, fallback=None
                     ) -> DraftTree | DeviceTree | None:
        """A sampled tree drafted on the device (``specdec.tree.drawn``), read
        once; None where a draft distribution was not finite. With
        ``fallback`` (the draft level by level, a callable), the tree stays on
        the device, unread and placed for its verify (a ``DeviceTree``), where
        a compiled verify is that wide."""
        root_hidden, root_logp = sess.root_out
        level = self._levels_on_device(sess, committed)
        draft = drawn.draft_drawn(sess.tokens[-1], root_hidden, root_logp, level, committed, cfg, sampler)
        width = width_bucket(draft.nodes)
        if fallback is None or width is None:
            return draft.resolve(draft.read.tolist())            # the draft's one read
        prefix = len(sess.tokens) - 1                            # the verifier's
        rows, table = draft.place(prefix, width)
        return DeviceTree(draft.read, PlacedTree(rows, draft.nodes, prefix), sess.tokens[-1],
                          len(drawn.level_widths(cfg)), fallback, parse=draft.resolve, table=table)

    def _draft_ranked(self, sess: DraftSession, cfg: TreeParams, committed: int, fallback=None
                      ) -> DraftTree | DeviceTree | None:
        """A top-token tree drafted on the device (``specdec.tree.ranked``): with
        ``fallback`` (the draft level by level, a callable) left there unread
        and placed for its verify (a ``DeviceTree``, whose reader takes the
        fallback where a tie flagged it), else read once; None where it was
        flagged (the host's builder decides the ties)."""
        root_hidden, root_logp = sess.root_out
        level = self._levels_on_device(sess, committed)
        prefix = len(sess.tokens) - 1                            # the verifier's
        nodes = ranked.nodes(cfg)
        width = width_bucket(nodes) if fallback is not None else None
        read, rows, n = ranked.draft_ranked(sess.tokens[-1], root_hidden, root_logp, level, committed, cfg,
                                            prefix, width)
        if rows is None:
            return tree_of_read(read.tolist(), n)                # the draft's one read
        return DeviceTree(read, PlacedTree(rows, n, prefix), sess.tokens[-1], min(cfg.depth, cfg.total_tokens - 1),
                          fallback)

    @torch.inference_mode()
    def _build(self, sess: DraftSession, cfg: TreeParams, record: bool, exclude: list[int] | None = None,
               graph: bool = True, fallback=None) -> tuple[DraftTree | DeviceTree, TreeRecord | None]:
        """The tree (and its record); ``exclude``: tokens kept off the first level
        (the others' log-probs renormalised); ``graph``: the whole-draft graph
        may serve it; ``fallback``: it may leave the tree on the device, unread
        (``draft_whole``)."""
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
            whole = None if not graph or exclude or cfg.proposals == "sampled" or sess.grammar is not None else \
                self.draft_whole(sess.cache, sess.tokens[-1], root_hidden, root_logp, cfg, fallback)
            if whole is not None:            # the whole draft in one graph (drafter.compiled.whole_draft)
                return whole[0], TreeRecord(whole[0], whole[1]) if record else None
            sampler = self.proposal_sampler(sess, cfg, root_logp.device)
            on_device = graph and not record and not exclude and sess.grammar is None
            if sampler is not None and on_device and drawn.serves(cfg):
                tree = self._draft_drawn(sess, cfg, sampler, committed, fallback)
                if tree is not None:
                    return tree, None
                kv.truncate(sess.cache, committed)
                sampler = self.proposal_sampler(sess, cfg)      # (the host's builder names the problem)
            if sampler is None and on_device and ranked.serves(cfg, root_logp.shape[-1]):
                tree = self._draft_ranked(sess, cfg, committed, fallback)
                if tree is not None:
                    return tree, None
                kv.truncate(sess.cache, committed)              # (flagged: the host's builder decides the ties)
            if sess.grammar is not None:
                expand = masked_expand(expand, sess.grammar)
            tree, ids = build_tree_ids(sess.tokens[-1], expand, cfg, sampler)
            if not record:
                return tree, None
            # a path the verifier may accept feeds the outputs of its nodes that have
            # children: those were all expanded
            none = torch.zeros_like(root_hidden)
            rec = TreeRecord(tree, torch.stack([hidden.get(n, none) for n in ids.tolist()]).float().cpu())
            return tree, rec
        finally:
            kv.truncate(sess.cache, committed)
