"""Batched verification: several sessions' trees in one target forward.

Sessions keep their own caches. For one batched step the prefixes are copied
into a padded batch cache [B, kv_heads, P + N, d] (P = longest prefix; row
b's slots past its own prefix are zeros and masked), each tree is padded to N
nodes and the forward writes the trees' slots in place after P. The mask row
of node i of session b allows its session's prefix plus its tree ancestors.
After the forward, each session appends only its accepted slots (in place,
``specdec.model.kv``) and commits exactly as an unbatched verify would.
Padding rows see only themselves so no softmax row is empty.

The prefix copy costs O(total KV) per step; on CPU, where a forward of a
small target is dominated by per-layer overhead, one forward for B sessions
still beats B forwards by far (see ``specdec bench --concurrency``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.compile.forwards import width_bucket
from specdec.model import kv
from specdec.request.errors import FailedPrecondition
from specdec.tree.build import DraftTree
from specdec.tree.placed import BITS, POSITIONS, ROWS, SEEN, TOKENS, PlacedTree, placed_lists
import specdec.serving.batching
from verifier.session import TargetSession, VerifyResult
from verifier.target import check_tree, select_features


@dataclass
class _Row:
    sid: str
    tree: DraftTree
    sess: TargetSession


def _check(engine, sid: str, tree: DraftTree) -> TargetSession:
    sess = engine.sessions.get(sid)
    check_tree(engine.target, sess, tree)
    return sess


def verify_batch(engine, items: list[tuple[str, DraftTree]]) -> list[VerifyResult | Exception]:
    """Verify and commit each (session, tree) of ``engine`` (a
    ``verifier.engine.VerifierEngine``: its ``target``, ``sessions`` and
    ``verify``); one result or error per item, in order. A session may appear
    at most once per batch. Where the target's forwards are compiled, the
    batch reads back once, whatever its size: the trees go up in one copy,
    every row is walked on the device, and their verdicts come back together."""
    results: list[VerifyResult | Exception] = [None] * len(items)  # type: ignore[list-item]
    rows: list[tuple[int, _Row]] = []
    seen: set[str] = set()
    for i, (sid, tree) in enumerate(items):
        try:
            if sid in seen:
                raise FailedPrecondition(f"session {sid!r} appears twice in one batch")
            seen.add(sid)
            rows.append((i, _Row(sid, tree, _check(engine, sid, tree))))
        except Exception as exc:  # noqa: BLE001 - reported per item
            results[i] = exc
    by_row = len(rows) > 1 and _row_by_row(engine.target, [row for _, row in rows])
    if len(rows) == 1 or (by_row and not _placeable(engine.target, [row for _, row in rows])):
        for i, row in rows:                             # nothing to pack, or rows verified apart
            try:
                results[i] = engine.verify(row.sid, row.tree)
            except Exception as exc:  # noqa: BLE001
                results[i] = exc
        return results
    if rows:
        locks = [row.sess.lock for _, row in rows]
        for lock in locks:
            lock.acquire()
        try:
            run = _rows_one_read if by_row else _forward_and_commit
            for (i, row), res in zip(rows, run(engine, [r for _, r in rows])):
                results[i] = res
        finally:
            for lock in locks:
                lock.release()
    return results


def _row_by_row(target, rows: list[_Row]) -> bool:
    """Whether these rows verify one at a time (``TargetModel.batches_row_by_row``)."""
    layers = tuple(sorted({i for r in rows for i in r.sess.feature_layers}))
    return target.batches_row_by_row([r.sess.cache for r in rows], [r.sess.prefix_len for r in rows],
                                     max(r.tree.size for r in rows), layers)


def _placeable(target, rows: list[_Row]) -> bool:
    """Whether every row's own compiled forward takes its tree placed on the device."""
    for r in rows:
        target.fit(r.sess.cache, r.tree.size)
        if not target.compiled.tree_applies(r.sess.cache, r.tree.size, r.sess.feature_layers):
            return False
    return True


def _rows_one_read(engine, rows: list[_Row]) -> list[VerifyResult | Exception]:
    """A batch no batched graph serves, row by row over the one-session compiled
    graphs, read back once: each row's tree placed and walked on the device
    (``TargetSession.walk_placed``), every verdict read together."""
    target = engine.target
    widths = [width_bucket(r.tree.size) for r in rows]
    wide = max(widths)
    host = [[row + [0] * (wide - w) for row in placed_lists(r.tree, r.sess.prefix_len, w)]
            for r, w in zip(rows, widths)]
    packed = torch.tensor(host, dtype=torch.long, device=target.device)      # every row's tree: one copy up
    walked, results = [], []
    for b, r in enumerate(rows):
        prefix = r.sess.prefix_len
        try:
            placed = PlacedTree(packed[b, :, :widths[b]], r.tree.size, prefix)
            target.fit(r.sess.cache, r.tree.size)
            hidden, logits = target.forward_placed(r.sess.cache, placed, r.sess.feature_layers)
            order, verdict, counted = r.sess.walk_placed(r.tree, placed, logits)
            kv.reorder_tail(r.sess.cache, prefix, order)
            walked.append((r, prefix, hidden, logits, order, verdict, counted))
            results.append(None)
        except Exception as exc:  # noqa: BLE001 - reported per item; the session keeps its prefix
            kv.truncate(r.sess.cache, prefix)
            results.append(exc)
    values = torch.cat([w[5] for w in walked]).tolist() if walked else []          # the batch's one read
    at, done = 0, iter(walked)
    for j, res in enumerate(results):
        if res is not None:
            continue
        r, prefix, hidden, logits, order, verdict, counted = next(done)
        verdict_values, at = values[at:at + verdict.shape[0]], at + verdict.shape[0]
        result = r.sess.acceptance(r.tree, verdict_values)
        results[j] = r.sess.keep(r.tree, prefix, result, hidden, logits, counted, order)
    return results


def _forward_and_commit(engine, rows: list[_Row]) -> list[VerifyResult]:
    """One batched forward of every row's tree (an eager one, or the batched
    graphs): the trees go up in one copy, the mask is built on the device
    from their bit sets, each row is walked there, and the verdicts come back
    in one read; each session then appends its kept slots and commits."""
    target = engine.target
    B = len(rows)
    prefixes = [r.sess.prefix_len for r in rows]
    sizes = [r.tree.size for r in rows]
    P, N = max(prefixes), max(sizes)
    device = target.device
    # every row's tree placed after its own prefix, N wide, and (prefix, size): one copy up
    host = [placed_lists(r.tree, p, N) + [[p, n] + [0] * (N - 2)] for r, p, n in zip(rows, prefixes, sizes)] \
        if N >= 2 else [placed_lists(r.tree, p, N) + [[p]] for r, p in zip(rows, prefixes)]
    packed = torch.tensor(host, dtype=torch.long, device=device)                # [B, ROWS + 1, N]
    prefix_of, size_of = packed[:, ROWS, 0], (packed[:, ROWS, 1] if N >= 2 else torch.ones_like(packed[:, ROWS, 0]))
    tokens, positions = packed[:, TOKENS], packed[:, POSITIONS]                 # [B, N]
    columns = torch.arange(N, device=device)
    real = columns[None] < size_of[:, None]                                     # [B, N]
    sees_prefix = (torch.arange(P, device=device)[None, None] < prefix_of[:, None, None]) & real[:, :, None]
    sees_tree = (packed[:, SEEN][:, :, None] & packed[:, BITS][:, None]) != 0   # [B, N, N]; a pad sees itself
    allowed = torch.cat([sees_prefix, sees_tree], dim=2)                        # [B, N, P + N]
    key_positions = torch.cat([torch.arange(P, device=device).expand(B, P), positions], dim=1)
    mask = target.masks(allowed, positions, key_positions, resident=True)

    # one forward captures every layer some session's features read (``TargetModel.run``)
    layers = tuple(sorted({i for r in rows for i in r.sess.feature_layers}))
    # one copy of every prefix, padded, with room for the trees: the forward writes them in place
    batch_cache = target.batch_cache([r.sess.cache for r in rows], prefixes, N, layers)
    final, captured, logits = target.run(batch_cache, tokens, positions, mask, layers, resident=True)

    walked = []
    for b, r in enumerate(rows):
        n = sizes[b]
        placed = PlacedTree(packed[b, :ROWS], n, prefixes[b])
        walked.append(r.sess.walk_placed(r.tree, placed, logits[b, :n]))
    values = torch.cat([verdict for _, verdict, _ in walked]).tolist()          # the batch's one read

    results, at = [], 0
    for b, (r, (order, verdict, counted)) in enumerate(zip(rows, walked)):
        n = sizes[b]
        result = r.sess.acceptance(r.tree, values[at:at + verdict.shape[0]])
        at += verdict.shape[0]
        kept = order[:len(result.accepted) + 1]
        target.append_row(r.sess.cache, batch_cache, b, P + kept)                # the accepted slots
        features = select_features(final[b].index_select(0, kept),
                                   None if captured is None else captured[b].index_select(0, kept), layers,
                                   r.sess.feature_layers)
        logprobs = r.sess.committed_logprobs(r.tree, result, logits[b, :n])
        committed = result.tokens(r.tree)
        if counted is not None:
            r.sess.history.advance(*counted)
        r.sess.commit(committed, counted=counted is not None)
        results.append(VerifyResult(result.accepted, committed, features, logprobs))
    target.reuse(batch_cache)
    return results


class BatchScheduler(specdec.serving.batching.BatchScheduler):
    """Concurrent verify calls run as one batched forward (``specdec.serving.batching``:
    a lone session never waits); ``runner(items)`` runs
    ``engine.verify_batch(items)`` where the model lives."""

    async def verify(self, sid: str, tree: DraftTree) -> tuple[VerifyResult, float]:
        """(result, seconds of the batched forward it was part of)."""
        return await self.submit((sid, tree))
