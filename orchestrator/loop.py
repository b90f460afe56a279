"""One generation over gRPC: the steps of ``specdec.local.generate``, with the
drafter and the verifier as services.

Per request (a session, the same id on both services):
  0. pin the session to the least loaded verifier and drafter
     (``orchestrator.routing``); no free verifier: RESOURCE_EXHAUSTED, none
     reachable: UNAVAILABLE; no free drafter: plain decoding;
  1. Verifier.Prefill -> first token (+ prompt features for an EAGLE drafter);
  2. Drafter.Prefill with prompt + first token;
  3. cycles of Drafter.Draft (carrying the tokens and features committed by the
     previous cycle: one drafter round trip per cycle) -> Verifier.Verify (which
     commits the accepted path) -> ``Decoding.add`` (EOS, max_new_tokens, stop
     strings), streaming what became final;
  4. Release on both services, whatever happened (shielded from cancellation).

Trees never reach deeper than the tokens still wanted (as ``cycle_config``
in the in-process loop); with no drafter, or method VANILLA, every tree is the
last committed token alone: plain decoding on the verifier.

Failover (``orchestrator.failover``): the committed tokens are the source of
truth, so losing a backend costs a re-prefill, never a token. A lost drafter
is replaced by another one prefilled with every committed token (and, for
EAGLE, every feature row the verifiers sent); with none left the request goes
on as plain decoding. A lost verifier is replaced by another one opened with
``resume`` on the committed tokens, and the failed call is repeated there (a
tree's root is the last committed token, so the same tree verifies); the
drafter session stays as it is. With no verifier left the request fails with
UNAVAILABLE; what was streamed stays valid. Greedy output is the same as an
undisturbed run; with sampling it stays a sample of the same distribution
(the resumed verifier starts its generator from the seed again).

Features travel from verifier to drafter as the verifier's ``Tensor`` message,
untouched. Time split per request (``draft_s + verify_s + network_s + other_s
= wall_s``): draft_s / verify_s are the compute times the services report
(the whole call where a response carries none: drafter prefill), network_s
the rest of each call's wall time (transport, serialization, queueing, calls
that failed) and other_s the orchestrator's own work (tokenizer, stream
writes).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import grpc

from orchestrator.failover import (
    FAILOVERS,
    FALLBACKS,
    FATAL_CODES,
    MAX_MOVES,
    MOVE_CODES,
    OPEN_MOVE_CODES,
    FeatureLog,
)
from orchestrator.routing import PROBE_TIMEOUT_S, Endpoint, Pool, Router
from orchestrator.text import Delta, TextStream
from specdec import knobs, metrics
from specdec.decoding import Decoding
from specdec.errors import ResourceExhausted, SpecdecError, Unavailable
from specdec.v1 import common_pb2, drafter_pb2, verifier_pb2

log = logging.getLogger("specdec.orchestrator")

RELEASE_TIMEOUT_S = 5.0
TREE_KNOBS = ("total_tokens", "depth", "expand_k")


class DeadlineExceeded(SpecdecError):
    code = "DEADLINE_EXCEEDED"


class BackendError(SpecdecError):
    """A verifier or drafter call failed; keeps its status code."""

    def __init__(self, backend: str, method: str, exc: grpc.aio.AioRpcError, address: str = ""):
        self.status = exc.code()
        self.code = self.status.name
        where = f"{backend} {address}" if address else backend
        super().__init__(f"{where} {method}: {exc.details() or self.code}")


@dataclass(frozen=True)
class Job:
    """A validated request."""

    session_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: common_pb2.SamplingParams          # seed always set
    tree: common_pb2.TreeParams | None           # explicit knobs; None: root-only trees
    logprobs: int | None = None                  # top alternatives per token's logprob; None: no logprobs


class Deadline:
    def __init__(self, timeout: float | None):
        self.at = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        if self.at is None:
            return None
        left = self.at - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("deadline exceeded")
        return left


def clamp_tree(params: common_pb2.TreeParams, limits: common_pb2.TreeParams) -> common_pb2.TreeParams:
    """``params`` with each knob at most the drafter's limit (0: no limit)."""
    out = common_pb2.TreeParams()
    out.CopyFrom(params)
    for name in TREE_KNOBS:
        limit = getattr(limits, name)
        if limit > 0:
            setattr(out, name, min(getattr(out, name), limit))
    return out


MIN_SHARED_TREE = 4     # a tree cut for load keeps at least this many nodes (root included)


def shared_tree_tokens(budget: int, sessions: int) -> int:
    """This session's tree size when ``sessions`` share a verify budget of ``budget`` nodes."""
    return max(MIN_SHARED_TREE, budget // max(1, sessions))


class Generation:
    """Runs one Job on the backends the router gives it, feeding a Decoding and a TextStream."""

    def __init__(self, router: Router, job: Job, decoding: Decoding, text: TextStream, deadline: Deadline,
                 verify_token_budget: int = 0, lookahead: int = 0, gate_by_kind: bool = False):
        self.router = router
        self.gate_by_kind = gate_by_kind    # the gate's min_tau follows the first pinned drafter's kind
        self.verify_token_budget = verify_token_budget
        self.lookahead = lookahead
        self.job = job
        self.dec = decoding
        self.text = text
        self.deadline = deadline
        self.times = decoding.stats.time_s
        self.drafts = 0                     # cycles that asked the drafter for a tree
        self.committed: list[int] = list(job.prompt_ids)   # prompt + every token the verifier committed
        self.verifier: Endpoint | None = None
        self.drafter: Endpoint | None = None
        self.features: FeatureLog | None = None    # kept while an EAGLE drafter may need re-prefilling
        self.pending_tokens: list[int] = []         # committed, not yet sent to the drafter
        self.pending_features = FeatureLog()
        self.tree: common_pb2.TreeParams | None = None   # job.tree clamped to the drafter's limits
        self.opened = False                 # the verifier holds the session
        self.moves = {"verifier": 0, "drafter": 0}
        self._excluded: dict[str, set[str]] = {"verifier": set(), "drafter": set()}
        self._refused_full = 0              # verifiers that answered RESOURCE_EXHAUSTED on opening
        self._abandoned: list[tuple[Pool, Endpoint]] = []   # may still hold the session: released at the end
        self._last_emit: float | None = None

    async def run(self, emit: Callable[[Delta], Awaitable[None]]) -> None:
        try:
            await self._generate(emit)
            await self._emit(self.text.finish(), emit)
        finally:
            await asyncio.shield(self._release())

    # -- the loop -------------------------------------------------------------------------
    async def _generate(self, emit) -> None:
        job = self.job
        self.verifier, _ = await self.router.verifiers.acquire(timeout_s=self._probe_timeout())
        if job.tree is not None:
            await self._pin_drafter(first=True)
        first = await self._on_verifier("Prefill", verifier_pb2.VerifierPrefillRequest(
            session_id=job.session_id, prompt_ids=job.prompt_ids, sampling=job.sampling,
            max_new_tokens=job.max_new_tokens, return_features=self.features is not None, logprobs=job.logprobs))
        self.opened = True
        await self._committed([first.token], first.features, emit, first.logprobs)
        if self.drafter is not None and not self.dec.done:
            await self._open_drafter()
        ahead: dict[tuple[int, ...], common_pb2.DraftTree] = {}
        last: tuple[int, ...] = ()
        while not self.dec.done:
            params = self._cycle_tree(self.job.max_new_tokens - len(self.dec.tokens))
            tree = ahead.get(last) if params is not None and self.drafter is not None else None
            if tree is not None:
                self.dec.stats.ahead_hits += 1
            if ahead:
                metrics.AHEAD_CYCLES.labels("hit" if tree is not None else "miss").inc()
            ahead = {}
            if tree is None and params is not None:
                tree = await self._draft(params)
            drafted = tree is not None
            if tree is None:
                tree = common_pb2.DraftTree(tokens=[self.committed[-1]], parents=[-1])
            request = verifier_pb2.VerifyRequest(session_id=job.session_id, tree=tree,
                                                 return_features=self._wants_features)
            if drafted and self._looks_ahead:
                result, ahead = await self._verify_and_draft_ahead(request, params)
            else:
                result = await self._on_verifier("Verify", request)
            self.dec.stats.record_cycle(len(tree.tokens), len(result.accepted_nodes))
            self.dec.gate.record(len(tree.tokens) > 1, len(result.tokens))
            last = tuple(result.tokens)
            await self._committed(list(result.tokens), result.features, emit, result.logprobs)

    @property
    def _looks_ahead(self) -> bool:
        """Draft one round ahead: greedy sessions (the outcome is the target's
        argmax, the most predictable) on a drafter that can."""
        return (self.lookahead > 0 and self.drafter is not None and self.job.sampling.temperature <= 0.0
                and self.drafter.info.drafts_ahead)

    async def _verify_and_draft_ahead(self, request, params: common_pb2.TreeParams):
        """Verify the tree while the drafter drafts the next round for its likeliest
        outcomes -> (verify result, {outcome tokens: tree}). Time the drafter
        needs beyond the verify counts as drafting; the rest is hidden."""
        verify_end = [0.0]

        async def verify_call():
            try:
                return await self._on_verifier("Verify", request)
            finally:
                verify_end[0] = time.perf_counter()

        verify = asyncio.ensure_future(verify_call())
        try:
            ahead = await self._draft_ahead(params, self.job.max_new_tokens - len(self.dec.tokens))
            ahead_end = time.perf_counter()
            result = await verify
        finally:
            if not verify.done():
                verify.cancel()
        self.times["draft"] += max(0.0, ahead_end - verify_end[0])
        return result, ahead

    async def _draft_ahead(self, params: common_pb2.TreeParams, tokens_left: int) -> dict:
        """DraftAhead carrying the pending commit; {} when it fails (the drafter
        is then replaced, as for a failed Draft)."""
        request = drafter_pb2.DraftAheadRequest(
            session_id=self.job.session_id, commit_tokens=self.pending_tokens, tree=params, count=self.lookahead,
            tokens_left=tokens_left,
            commit_features=self.pending_features.tensor() if self.pending_tokens else None)
        try:
            response = await self._call("drafter", self.drafter, "DraftAhead", request, account=False)
        except BackendError as exc:
            if await self._leave_drafter(exc, opening=False):
                await self._open_drafter()
            return {}
        self.pending_tokens = []
        self.pending_features.clear()
        return {tuple(t.commit_tokens): t.tree for t in response.trees}

    @property
    def _wants_features(self) -> bool:
        return self.drafter is not None and self.features is not None

    async def _committed(self, tokens: list[int], features: common_pb2.Tensor, emit, logprobs=()) -> None:
        """What the verifier committed: into the request state, then to the client."""
        self.committed.extend(tokens)
        if self._wants_features:
            try:
                self.features.add(features)
                self.pending_features.add(features)
            except ValueError as exc:
                self._drop_drafter("features", str(exc))
        if self.drafter is not None:
            self.pending_tokens.extend(tokens)
        await self._commit(tokens, emit, list(logprobs))

    async def _draft(self, params: common_pb2.TreeParams) -> common_pb2.DraftTree | None:
        """This cycle's tree (carrying the pending commit), or None for a root-only tree."""
        while self.drafter is not None:
            request = drafter_pb2.DraftRequest(
                session_id=self.job.session_id, commit_tokens=self.pending_tokens, tree=params,
                commit_features=self.pending_features.tensor() if self.pending_tokens else None,
                ahead=self._looks_ahead)
            try:
                draft = await self._call("drafter", self.drafter, "Draft", request)
            except BackendError as exc:
                if await self._leave_drafter(exc, opening=False):
                    await self._open_drafter()
                continue
            self.pending_tokens = []
            self.pending_features.clear()
            self.drafts += 1
            return draft.tree
        return None

    def _cycle_tree(self, remaining: int) -> common_pb2.TreeParams | None:
        """This cycle's tree knobs: never deeper than the tokens still wanted."""
        if self.tree is None or remaining <= 1 or not self.dec.gate.speculate():
            return None
        params = common_pb2.TreeParams()
        params.CopyFrom(self.tree)
        params.depth = min(params.depth, remaining - 1)
        if self.verify_token_budget > 0 and self.verifier is not None:
            share = shared_tree_tokens(self.verify_token_budget, self.verifier.sessions)
            params.total_tokens = min(params.total_tokens, share) if params.total_tokens else share
        return params

    async def _commit(self, tokens: list[int], emit, logprobs: list | None = None) -> None:
        first = not self.dec.tokens
        self.dec.add(tokens, logprobs)
        if first and self.dec.tokens:
            metrics.TTFT.observe(self.dec.stats.ttft_s)
        await self._emit(self.text.take(), emit)

    async def _emit(self, delta: Delta, emit) -> None:
        if not delta.token_ids and not delta.text:
            return
        now = time.perf_counter()
        if self._last_emit is not None and delta.token_ids:
            per_token = (now - self._last_emit) / len(delta.token_ids)
            for _ in delta.token_ids:
                metrics.INTER_TOKEN_LATENCY.observe(per_token)
        if delta.token_ids:
            self._last_emit = now
        await emit(delta)

    # -- the verifier, moved when lost ---------------------------------------------------------
    async def _on_verifier(self, name: str, request):
        """A verifier call that survives losing the verifier: the session moves
        to another one (resumed from the committed tokens) and the call is
        repeated there."""
        while True:
            try:
                return await self._call("verifier", self.verifier, name, request)
            except BackendError as exc:
                await self._leave_verifier(exc, opening=not self.opened)
            if self.opened:
                await self._resume_verifier()

    async def _resume_verifier(self) -> None:
        """Open the session on the newly pinned verifier from the committed tokens."""
        remaining = self.job.max_new_tokens - len(self.dec.tokens)
        request = verifier_pb2.VerifierPrefillRequest(
            session_id=self.job.session_id, prompt_ids=self.committed, sampling=self.job.sampling,
            max_new_tokens=max(remaining, 0), resume=True, logprobs=self.job.logprobs,
            prompt_tokens=len(self.job.prompt_ids))
        while True:
            try:
                await self._call("verifier", self.verifier, "Prefill", request)
                return
            except BackendError as exc:
                await self._leave_verifier(exc, opening=True)

    async def _leave_verifier(self, exc: BackendError, opening: bool) -> None:
        """Give up the pinned verifier after ``exc`` and pin another one; raises
        ``exc`` when it is not a reason to move, Unavailable / ResourceExhausted
        when no verifier can take the session."""
        pool, old = self.router.verifiers, self.verifier
        codes = OPEN_MOVE_CODES if opening else MOVE_CODES
        if exc.status not in codes or self.moves["verifier"] >= MAX_MOVES:
            raise exc
        self._unpin(pool, old, exc)
        if exc.status == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._refused_full += 1
        self.moves["verifier"] += 1
        self.verifier = None
        try:
            self.verifier, _ = await pool.acquire(frozenset(self._excluded["verifier"]),
                                                  timeout_s=self._probe_timeout())
        except (Unavailable, ResourceExhausted) as none_left:
            if not self.opened and (self._refused_full or isinstance(none_left, ResourceExhausted)):
                raise ResourceExhausted(f"all verifiers are at capacity ({self._refused_full} refused "
                                        f"the session, no other is free)") from None
            if self.opened:
                raise Unavailable(f"lost the verifier ({exc}) and no other verifier can take the session: "
                                  f"{none_left}") from None
            raise
        if self.opened:
            FAILOVERS.labels("verifier").inc()
            log.warning("verifier lost, resuming the session on another", extra={
                "session": self.job.session_id, "error": str(exc), "verifier": self.verifier.address,
                "committed": len(self.committed)})

    # -- the drafter, replaced when lost -------------------------------------------------------
    async def _pin_drafter(self, first: bool = False) -> bool:
        """Pin the least loaded drafter that can continue this session; False
        (and plain decoding from now on) when there is none."""
        if first:
            accept = None
        else:     # a drafter that needs features can only take over if they were kept
            accept = (lambda e: self.features is not None or not e.info.needs_features)
        endpoint, reason = await self.router.drafters.acquire(frozenset(self._excluded["drafter"]), accept,
                                                              optional=True, timeout_s=self._probe_timeout())
        if endpoint is None:
            self._fall_back(f"drafters_{reason}", f"no drafter can take the session ({reason})")
            return False
        self.drafter = endpoint
        if first and self.gate_by_kind:
            self.dec.gate.min_tau = knobs.default_min_tau(endpoint.info.kind)
        if first and endpoint.info.needs_features:
            self.features = FeatureLog()
        self.tree = clamp_tree(self.job.tree, endpoint.info.max_tree)
        return True

    async def _open_drafter(self) -> None:
        """Prefill the pinned drafter with every committed token (and feature row);
        another drafter if it fails, none (plain decoding) if all do."""
        while self.drafter is not None:
            request = drafter_pb2.DrafterPrefillRequest(
                session_id=self.job.session_id, token_ids=self.committed,
                features=self.features.tensor() if self.drafter.info.needs_features else None,
                greedy=self.job.sampling.temperature <= 0.0, sampling=self.job.sampling)
            try:
                await self._call("drafter", self.drafter, "Prefill", request)
            except BackendError as exc:
                await self._leave_drafter(exc, opening=True)
                continue
            self.pending_tokens = []
            self.pending_features.clear()
            return

    async def _leave_drafter(self, exc: BackendError, opening: bool) -> bool:
        """Give up the pinned drafter after ``exc``; True when another one was pinned
        (it needs ``_open_drafter``), False when the request goes on without."""
        if exc.status in FATAL_CODES:
            raise exc
        pool, old = self.router.drafters, self.drafter
        codes = OPEN_MOVE_CODES if opening else MOVE_CODES
        self._unpin(pool, old, exc)
        self.drafter = None
        if exc.status not in codes:
            self._fall_back("drafter_error", str(exc))
            return False
        if self.moves["drafter"] >= MAX_MOVES:
            self._fall_back("moves_exhausted", str(exc))
            return False
        self.moves["drafter"] += 1
        if not await self._pin_drafter():
            return False
        FAILOVERS.labels("drafter").inc()
        log.warning("drafter lost, re-prefilling another", extra={
            "session": self.job.session_id, "error": str(exc), "drafter": self.drafter.address,
            "committed": len(self.committed)})
        return True

    def _drop_drafter(self, reason: str, error: str) -> None:
        if self.drafter is not None:
            self.router.drafters.unpin(self.drafter)
            self._abandoned.append((self.router.drafters, self.drafter))
            self.drafter = None
        self._fall_back(reason, error)

    def _fall_back(self, reason: str, error: str) -> None:
        FALLBACKS.labels(reason).inc()
        self.tree = None
        log.warning("going on with plain decoding", extra={"session": self.job.session_id, "reason": reason,
                                                           "error": error})

    def _unpin(self, pool: Pool, endpoint: Endpoint, exc: BackendError) -> None:
        """Stop using ``endpoint`` for this session after ``exc``."""
        pool.unpin(endpoint)
        if exc.status == grpc.StatusCode.UNAVAILABLE:
            pool.failed(endpoint, str(exc))
        if exc.status != grpc.StatusCode.NOT_FOUND:
            # a restarted server (NOT_FOUND) may take the session again; others are done for this request
            self._excluded[pool.role].add(endpoint.address)
        if exc.status not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED):
            self._abandoned.append((pool, endpoint))

    # -- calls ----------------------------------------------------------------------------
    def _probe_timeout(self) -> float:
        """How long a probe made on behalf of this request may take."""
        left = self.deadline.remaining()
        return PROBE_TIMEOUT_S if left is None else min(PROBE_TIMEOUT_S, left)

    async def _call(self, backend: str, endpoint: Endpoint, name: str, request, account: bool = True):
        """One backend call under the request's deadline; accounts its time
        (``account``: a call that runs beside another is accounted by the caller)."""
        start = time.perf_counter()
        try:
            response = await getattr(endpoint.stub, name)(request, timeout=self.deadline.remaining())
        except grpc.aio.AioRpcError as exc:
            if account:
                self.times["network"] += time.perf_counter() - start
            raise BackendError(backend, name, exc, endpoint.address) from None
        if not account:
            return response
        wall = time.perf_counter() - start
        compute = min(getattr(response, "compute_s", wall), wall)
        self.times["draft" if backend == "drafter" else "verify"] += compute
        self.times["network"] += wall - compute
        return response

    async def _release(self) -> None:
        sid = self.job.session_id
        pinned = [(self.router.verifiers, self.verifier), (self.router.drafters, self.drafter)]
        for pool, endpoint in pinned:
            if endpoint is not None:
                pool.unpin(endpoint)
        current = [(pool, e) for pool, e in pinned
                   if e is not None and not (e is self.verifier and not self.opened)]

        async def release(pool: Pool, endpoint: Endpoint) -> None:
            if pool.role == "verifier":
                request = verifier_pb2.VerifierReleaseRequest(session_id=sid)
            else:
                request = drafter_pb2.DrafterReleaseRequest(session_id=sid)
            try:
                await endpoint.stub.Release(request, timeout=RELEASE_TIMEOUT_S)
            except Exception as exc:      # a lost backend's failure is expected, the others' worth a line
                if (pool, endpoint) in current:
                    log.warning("release failed", extra={"session": sid, "backend": endpoint.address,
                                                         "error": str(exc)})

        await asyncio.gather(*(release(p, e) for p, e in current + self._abandoned))

    def timing(self) -> dict[str, float]:
        """draft_s, verify_s, network_s, other_s; they add up to wall_s."""
        t = self.times
        wall = self.dec.stats.wall_s
        split = {"draft_s": t["draft"], "verify_s": t["verify"], "network_s": t["network"]}
        split["other_s"] = max(0.0, wall - sum(split.values()))
        return split
