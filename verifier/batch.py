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

from specdec.request.errors import FailedPrecondition
from specdec.tree.build import DraftTree
import specdec.serving.batching
from verifier.target import TargetSession, VerifyResult, check_tree, select_features


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
    at most once per batch."""
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
    if len(rows) == 1 or _row_by_row(engine.target, [row for _, row in rows]):     # nothing to pack
        for i, row in rows:
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
            for (i, row), res in zip(rows, _forward_and_commit(engine, [r for _, r in rows])):
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


def _forward_and_commit(engine, rows: list[_Row]) -> list[VerifyResult]:
    target = engine.target
    B = len(rows)
    prefixes = [r.sess.prefix_len for r in rows]
    sizes = [r.tree.size for r in rows]
    P, N = max(prefixes), max(sizes)
    device = target.device
    tokens = torch.zeros(B, N, dtype=torch.long)
    positions = torch.zeros(B, N, dtype=torch.long)
    allowed = torch.zeros(B, N, P + N, dtype=torch.bool)
    for b, r in enumerate(rows):
        n, p = sizes[b], prefixes[b]
        tokens[b, :n] = r.tree.tokens
        positions[b, :n] = r.tree.position_ids(p)
        allowed[b, :n, :p] = True
        allowed[b, :n, P:P + n] = r.tree.ancestor_mask()
        idx = torch.arange(n, N)
        allowed[b, idx, P + idx] = True        # padding rows: themselves only
    key_positions = torch.cat([torch.arange(P).expand(B, P), positions], dim=1)    # [B, P + N]
    mask = target.masks(allowed, positions, key_positions)

    # one forward captures every layer some session's features read (``TargetModel.run``)
    layers = tuple(sorted({i for r in rows for i in r.sess.feature_layers}))
    # one copy of every prefix, padded, with room for the trees: the forward writes them in place
    batch_cache = target.batch_cache([r.sess.cache for r in rows], prefixes, N, layers)
    final, captured, logits = target.run(batch_cache, tokens, positions, mask, layers)   # [B, N, H], .., [B, N, V]

    results = []
    for b, r in enumerate(rows):
        n = sizes[b]
        result, logprobs = r.sess.decide(r.tree, logits[b, :n])
        path = [0] + result.accepted
        target.append_row(r.sess.cache, batch_cache, b, P + torch.tensor(path, device=device))   # the accepted slots
        committed = result.tokens(r.tree)
        r.sess.commit(committed)
        features = select_features(final[b, path], None if captured is None else captured[b, path], layers,
                                   r.sess.feature_layers)
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
