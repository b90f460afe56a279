"""The loop's verifier and drafter over gRPC, with failover inside: losing a
backend costs a re-prefill, never a token.

``RemoteVerifier`` and ``RemoteDrafter`` implement ``specdec.request.speculative``'s
``Verifier`` and ``Drafter`` for one session, pinned by the router
(``orchestrator.routing``) to an endpoint of their pool; they convert the
loop's parameters to protos and hand trees and features through untouched.

The committed tokens (prompt + everything the verifier committed) are the
source of truth, and each handle keeps what it was told of them:
- a lost verifier is replaced by another one opened with ``resume`` on the
  committed tokens (their KV is recomputed, the last token is the pending
  root again, nothing is sampled) and the failed call is repeated there (a
  tree's root is the last committed token, so the same tree verifies); with
  no verifier left the request fails with UNAVAILABLE;
- a lost drafter is replaced by another one prefilled with every committed
  token and, for EAGLE, every feature row the verifier sent; with none left
  ``draft`` hands back "no drafter" and the loop goes on as plain decoding.
Greedy output is the same as an undisturbed run; with sampling it stays a
sample of the same distribution (the resumed verifier starts its generator
from the seed again).

An EAGLE drafter needs the target's feature row before every committed token
but the first; the verifier sent each of them once (prefill: one per prompt
token, each cycle: one per committed token), so the drafter handle keeps
those ``Tensor`` messages in a ``FeatureLog`` and concatenates their raw
bytes: same dtype, row-major [n, H] each, so the bytes of [n1, H] then
[n2, H] are those of [n1 + n2, H]. No torch needed.

Which failures move a session (``MOVE_CODES``): the backend is gone
(UNAVAILABLE, which connection errors are too) or no longer knows the session
(NOT_FOUND: restarted or evicted). Opening a session may also meet a full
server (RESOURCE_EXHAUSTED): try the next. A backend answering CANCELLED is
stopping (it cancels its calls): that is UNAVAILABLE too (``Backend.failure``).
INVALID_ARGUMENT, FAILED_PRECONDITION and DEADLINE_EXCEEDED are never retried.

Pinning, calls under the request's deadline, transport time and release are
``orchestrator.backend``'s.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import grpc
from prometheus_client import Counter

from specdec.request import wire
from specdec.request.errors import ResourceExhausted, Unavailable
from specdec.request.params import SamplingParams, TreeParams
from specdec.request.speculative import Committed, Draft, SelfDraft
from specdec.request.wire import FeatureLog, clamp_tree
from specdec.serving.metrics import REGISTRY
from specdec.v1 import common_pb2, drafter_pb2, verifier_pb2
from orchestrator.backend import Backend, BackendError, Deadline
from orchestrator.lease import Leases
from orchestrator.routing import Pool

log = logging.getLogger("specdec.orchestrator")

MOVE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND})
OPEN_MOVE_CODES = MOVE_CODES | {grpc.StatusCode.RESOURCE_EXHAUSTED}
# Failures that end the request whichever backend reports them (its deadline passed).
FATAL_CODES = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED})
# A request gives up moving a role's session after this many moves (a server
# that keeps forgetting sessions must not keep a request spinning).
MAX_MOVES = 8

# reason: drafters_full | drafters_unavailable (none reachable, or none can take
# the session over) | drafter_error (a status that is no reason to move) |
# moves_exhausted | features (rows that do not continue the log)
FALLBACKS = Counter("specdec_fallback_total",
                    "Requests that asked for drafting but went on (from the start or from some point) as "
                    "plain decoding, by reason.", ["reason"], registry=REGISTRY)
FAILOVERS = Counter("specdec_failovers_total", "Sessions moved to another backend after losing one, by role.",
                    ["role"], registry=REGISTRY)


class RemoteVerifier(Backend):
    """``speculative.Verifier`` over the verifier pool: a session that moves to
    another verifier when it loses its own."""

    role = "verifier"
    stream_steps = {"Prefill": "prefill", "Verify": "verify"}
    session_request = verifier_pb2.VerifierSessionRequest

    def __init__(self, pool: Pool, session_id: str, deadline: Deadline, leases: Leases,
                 logprobs: int | None = None, streams: bool = True, prompt_logprobs: int | None = None,
                 cache_salt: str = ""):
        super().__init__(pool, session_id, deadline, leases, streams)
        self.cache_salt = cache_salt             # the verifier's prefix cache shares blocks within it
        self.logprobs = logprobs                 # top alternatives per token's logprob; None: no logprobs
        self.prompt_logprobs = prompt_logprobs   # the same for the prompt's tokens (the Prefill's)
        self.opened = False                      # the pinned verifier answered the session's Prefill
        self.refused_full = 0                    # verifiers that answered RESOURCE_EXHAUSTED on opening
        self.committed: list[int] = []           # prompt + every token committed
        self.verify_wall_s = 0.0                 # the last Verify's wall time (what drafting ahead hides behind)
        self.prompt_len = 0
        self.max_new_tokens = 0
        self.sampling = common_pb2.SamplingParams()
        self.feature_layers: list[int] = []       # the pinned drafter's (DrafterGetInfoResponse), kept on a move
        self.self_drafts = 0                      # cycles whose tree the verifier drafted (lookahead decoding)

    @property
    def sessions(self) -> int:
        return self.endpoint.sessions if self.endpoint is not None else 1

    async def pin(self) -> None:
        """Pin the least loaded verifier; none free: ResourceExhausted, none reachable: Unavailable."""
        self.endpoint, _ = await self.pool.acquire(timeout_s=self.probe_timeout())

    async def prefill(self, prompt: list[int], sampling: SamplingParams, max_new_tokens: int,
                      features: bool) -> Committed:
        self.sampling = wire.sampling_to_proto(sampling)
        self.prompt_len, self.max_new_tokens = len(prompt), max_new_tokens
        first = await self.on_verifier("Prefill", verifier_pb2.VerifierPrefillRequest(
            session_id=self.session_id, prompt_ids=prompt, sampling=self.sampling, max_new_tokens=max_new_tokens,
            return_features=features, owner=self.leases.owner, logprobs=self.logprobs,
            feature_layers=self.feature_layers if features else [], prompt_logprobs=self.prompt_logprobs,
            cache_salt=self.cache_salt))
        self.opened = True
        self.committed = [*prompt, first.token]
        scored = wire.logprobs_from_proto(first.prompt_logprobs) if self.prompt_logprobs is not None else None
        return Committed([first.token], [], first.features, self.read_logprobs(first.logprobs),
                         prompt_logprobs=scored)

    async def verify(self, draft: Draft | None, features: bool) -> Committed:
        """Verify ``draft``; a ``SelfDraft`` (lookahead decoding) asks the verifier to draft the tree itself."""
        depth = draft.tree.depth if draft is not None and isinstance(draft.tree, SelfDraft) else 0
        self.self_drafts += depth > 0
        tree = draft.tree if draft is not None and not depth else \
            common_pb2.DraftTree(tokens=[self.committed[-1]], parents=[-1])
        start = time.perf_counter()
        result = await self.on_verifier("Verify", verifier_pb2.VerifyRequest(
            session_id=self.session_id, tree=tree, return_features=features, lookahead_depth=depth))
        self.verify_wall_s = time.perf_counter() - start
        self.committed.extend(result.tokens)
        return Committed(list(result.tokens), list(result.accepted_nodes), result.features,
                         self.read_logprobs(result.logprobs), result.verified_nodes)

    def read_logprobs(self, msgs) -> list | None:
        """The tokens' logprobs as ``specdec.request.params.TokenLogprob``; None when the session asked for none."""
        return wire.logprobs_from_proto(msgs) if self.logprobs is not None else None

    def release_request(self):
        return verifier_pb2.VerifierReleaseRequest(session_id=self.session_id)

    # -- failover --------------------------------------------------------------------------
    async def on_verifier(self, name: str, request):
        """A call that survives losing the verifier: the session moves to another
        one (resumed from the committed tokens) and the call is repeated there."""
        while True:
            try:
                return await self.call(name, request)
            except BackendError as exc:
                await self.leave(exc, opening=not self.opened)
            if self.opened:
                await self.resume()

    async def resume(self) -> None:
        """Open the session on the newly pinned verifier from the committed tokens
        (the first ``prompt_len`` of them the prompt, which the repetition
        penalty counts apart from the output)."""
        remaining = self.max_new_tokens - (len(self.committed) - self.prompt_len)
        request = verifier_pb2.VerifierPrefillRequest(
            session_id=self.session_id, prompt_ids=self.committed, sampling=self.sampling,
            max_new_tokens=max(remaining, 0), resume=True, owner=self.leases.owner, logprobs=self.logprobs,
            prompt_tokens=self.prompt_len, feature_layers=self.feature_layers, cache_salt=self.cache_salt)
        while True:
            try:
                await self.call("Prefill", request)
                return
            except BackendError as exc:
                await self.leave(exc, opening=True)

    async def leave(self, exc: BackendError, opening: bool) -> None:
        """Give up the pinned verifier after ``exc`` and pin another one; raises
        ``exc`` when it is not a reason to move, Unavailable / ResourceExhausted
        when no verifier can take the session."""
        codes = OPEN_MOVE_CODES if opening else MOVE_CODES
        if exc.status not in codes or self.moves >= MAX_MOVES:
            raise exc
        self.unpin(exc)
        if exc.status == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.refused_full += 1
        self.moves += 1
        try:
            self.endpoint, _ = await self.pool.acquire(frozenset(self.excluded), timeout_s=self.probe_timeout())
        except (Unavailable, ResourceExhausted) as none_left:
            if not self.opened and (self.refused_full or isinstance(none_left, ResourceExhausted)):
                raise ResourceExhausted(f"all verifiers are at capacity ({self.refused_full} refused "
                                        f"the session, no other is free)") from None
            if self.opened:
                raise Unavailable(f"lost the verifier ({exc}) and no other verifier can take the session: "
                                  f"{none_left}") from None
            raise
        if self.opened:
            FAILOVERS.labels("verifier").inc()
            log.warning("verifier lost, resuming the session on another", extra={
                "session": self.session_id, "error": str(exc), "verifier": self.endpoint.address,
                "committed": len(self.committed)})


class RemoteDrafter(Backend):
    """``speculative.Drafter`` over the drafter pool: a session re-prefilled on
    another drafter when it loses its own, or none ("no drafter": plain decoding)."""

    role = "drafter"
    stream_steps = {"Prefill": "prefill", "Draft": "draft", "DraftAhead": "draft_ahead"}
    session_request = drafter_pb2.DrafterSessionRequest

    def __init__(self, pool: Pool, session_id: str, deadline: Deadline, leases: Leases, streams: bool = True,
                 cache_salt: str = ""):
        super().__init__(pool, session_id, deadline, leases, streams)
        self.cache_salt = cache_salt              # the drafter's prefix cache shares blocks within it
        self.features: FeatureLog | None = None   # every feature row, kept while an EAGLE drafter may need them
        self.feature_layers: list[int] = []       # the target layers those rows come from
        self.committed: list[int] = []            # every token this handle was given
        self.sampling = common_pb2.SamplingParams()
        self.drafts = 0                           # trees drafted (Draft calls that answered)
        self.ahead_s = 0.0                        # drafter compute of the DraftAhead calls
        # seconds a DraftAhead may take (the verify it hides behind); None: no limit
        self.ahead_budget: Callable[[], float] | None = None

    @property
    def kind(self) -> str:
        return self.endpoint.info.kind

    @property
    def needs_features(self) -> bool:
        return self.endpoint is not None and self.features is not None

    @property
    def drafts_ahead(self) -> bool:
        return self.endpoint is not None and self.endpoint.info.drafts_ahead

    async def pin(self, first: bool = False) -> bool:
        """Pin the least loaded drafter that can continue this session; False
        (and plain decoding from now on) when there is none."""
        if first:
            accept = None
        else:     # a drafter that needs features can only take over if they were kept, from its layers
            accept = (lambda e: not e.info.needs_features or (
                self.features is not None and list(e.info.feature_layers) == self.feature_layers))
        endpoint, reason = await self.pool.acquire(frozenset(self.excluded), accept, optional=True,
                                                   timeout_s=self.probe_timeout())
        if endpoint is None:
            self.fall_back(f"drafters_{reason}", f"no drafter can take the session ({reason})")
            return False
        self.endpoint = endpoint
        if first and endpoint.info.needs_features:
            self.features = FeatureLog()
            self.feature_layers = list(endpoint.info.feature_layers)
        return True

    async def prefill(self, tokens: list[int], features, sampling: SamplingParams) -> None:
        self.sampling = wire.sampling_to_proto(sampling)
        self.committed = list(tokens)
        if self.features is not None and not self.keep_features([features], FeatureLog()):
            return
        await self.open()

    async def draft(self, commits: list[Committed], tree: TreeParams, ahead: bool) -> Draft | None:
        """This cycle's tree (carrying ``commits``), or None: no drafter left."""
        tokens, features = self.take(commits)
        while self.endpoint is not None:
            request = drafter_pb2.DraftRequest(
                session_id=self.session_id, commit_tokens=tokens, tree=self.fit(tree),
                commit_features=features.tensor() if tokens else None, ahead=ahead and self.drafts_ahead)
            try:
                response = await self.call("Draft", request)
            except BackendError as exc:
                if await self.leave(exc, opening=False):
                    await self.open()
                tokens, features = [], FeatureLog()     # a new drafter was prefilled with them
                continue
            self.drafts += 1
            return Draft(response.tree, len(response.tree.tokens))
        return None

    async def draft_ahead(self, commits: list[Committed], tree: TreeParams, count: int,
                          tokens_left: int) -> dict[tuple[int, ...], Draft]:
        """DraftAhead carrying ``commits``; {} when it fails (the drafter is then
        replaced, as for a failed Draft)."""
        tokens, features = self.take(commits)
        if self.endpoint is None:
            return {}
        request = drafter_pb2.DraftAheadRequest(
            session_id=self.session_id, commit_tokens=tokens, tree=self.fit(tree), count=count,
            tokens_left=tokens_left, commit_features=features.tensor() if tokens else None,
            budget_s=self.ahead_budget() if self.ahead_budget is not None else 0.0)
        try:
            response = await self.call("DraftAhead", request, account=False)
        except BackendError as exc:
            if await self.leave(exc, opening=False):
                await self.open()
            return {}
        self.ahead_s += response.compute_s
        return {tuple(t.commit_tokens): Draft(t.tree, len(t.tree.tokens)) for t in response.trees}

    def release_request(self):
        return drafter_pb2.DrafterReleaseRequest(session_id=self.session_id)

    # -- what the session was told ---------------------------------------------------------------
    def fit(self, tree: TreeParams) -> common_pb2.TreeParams:
        """The loop's knobs as the pinned drafter's message, within its limits."""
        return clamp_tree(wire.tree_params_to_proto(tree), self.endpoint.info.max_tree)

    def take(self, commits: list[Committed]) -> tuple[list[int], FeatureLog]:
        """Record ``commits`` (tokens, and feature rows into the log); returns them
        joined, to send with the next call."""
        if self.endpoint is None:
            return [], FeatureLog()
        tokens = [t for c in commits for t in c.tokens]
        self.committed.extend(tokens)
        joined = FeatureLog()
        if self.features is not None:
            self.keep_features([c.features for c in commits], joined)
        return tokens, joined

    def keep_features(self, parts: list[common_pb2.Tensor], joined: FeatureLog) -> bool:
        """Append ``parts`` to the log and to ``joined``; rows that do not continue
        the log drop the drafter (False)."""
        try:
            for part in parts:
                self.features.add(part)
                joined.add(part)
        except ValueError as exc:
            self.drop("features", str(exc))
            return False
        return True

    # -- failover --------------------------------------------------------------------------
    async def open(self) -> None:
        """Prefill the pinned drafter with every committed token (and feature row);
        another drafter if it fails, none (plain decoding) if all do."""
        while self.endpoint is not None:
            request = drafter_pb2.DrafterPrefillRequest(
                session_id=self.session_id, token_ids=self.committed,
                features=self.features.tensor() if self.endpoint.info.needs_features else None,
                greedy=self.sampling.temperature <= 0.0, sampling=self.sampling, owner=self.leases.owner,
                cache_salt=self.cache_salt)
            try:
                await self.call("Prefill", request)
            except BackendError as exc:
                await self.leave(exc, opening=True)
                continue
            return

    async def leave(self, exc: BackendError, opening: bool) -> bool:
        """Give up the pinned drafter after ``exc``; True when another one was pinned
        (it needs ``open``), False when the session goes on without."""
        if exc.status in FATAL_CODES:
            raise exc
        codes = OPEN_MOVE_CODES if opening else MOVE_CODES
        self.unpin(exc)
        if exc.status not in codes:
            self.fall_back("drafter_error", str(exc))
            return False
        if self.moves >= MAX_MOVES:
            self.fall_back("moves_exhausted", str(exc))
            return False
        self.moves += 1
        if not await self.pin():
            return False
        FAILOVERS.labels("drafter").inc()
        log.warning("drafter lost, re-prefilling another", extra={
            "session": self.session_id, "error": str(exc), "drafter": self.endpoint.address,
            "committed": len(self.committed)})
        return True

    def drop(self, reason: str, error: str) -> None:
        if self.endpoint is not None:
            self.pool.unpin(self.endpoint)
            self.abandoned.append(self.endpoint)
            self.endpoint, self.sent_prefill = None, False
            self.close_stream()
        self.fall_back(reason, error)

    def fall_back(self, reason: str, error: str) -> None:
        FALLBACKS.labels(reason).inc()
        log.warning("going on with plain decoding", extra={"session": self.session_id, "reason": reason,
                                                           "error": error})
