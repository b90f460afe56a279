"""The direct plane (the Run RPC): one request's speculative loop run on its
verifier, drafting on the paired drafter directly.

The orchestrator pins a verifier and a drafter, then sends the verifier one
``RunStart``: the session as a Prefill opens it, the drafter's address and
the standing policy (tree knobs, drafting ahead, the verify budget, the
speculation gate, the EOS ids). The verifier runs ``specdec.request.speculative``'s
loop over itself (``ServedVerifier``: each step is its own Prefill / Verify
handler, with their checks, batching and tree sizing) and the drafter
(``verifier.paired.PairedDrafter``), so a cycle's critical path is one
message to the drafter (the commits) and one back (the tree), and none when
the tree was drafted ahead for the outcome that came. Each commit goes out on
the Run stream as it is made (``RunCommit``): the orchestrator applies its
own stops (stop strings) and streams to its caller off the critical path. A
``RunStop`` ends the run after the cycle in flight; what was committed past
the caller's stop is never shown (the session ends with the run). The
summary (``RunDone``) closes the stream.

Resuming (``prefill.resume``, the orchestrator's failover after losing a
verifier): the committed tokens are the prompt, the last of them the pending
root; nothing is sampled, nothing added to the output, and the drafter is
prefilled with all of them.

May import: ``specdec.request``, ``specdec.serving``, ``specdec.v1`` and ``verifier.paired``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import grpc

from specdec.request import wire
from specdec.request.decoding import Decoding, StopCriteria
from specdec.request.pace import Pace, knobs_key
from specdec.request.errors import InvalidArgument
from specdec.request.checks import check_count
from specdec.request.params import LOOKAHEAD, TreeParams
from specdec.request.speculative import Committed, Draft, Request, SelfDraft, SpeculativeLoop
from specdec.request.wire import FeatureLog
from specdec.v1 import common_pb2, verifier_pb2
from verifier.paired import PairedDrafter

log = logging.getLogger("specdec.verifier")

MAX_LOOKAHEAD = 8
AHEAD_BUDGET_SHARE = 0.9        # drafting ahead may take this share of the last verify's time


class ServedVerifier:
    """``speculative.Verifier`` over this verifier's own handlers (one session)."""

    network_s = 0.0

    def __init__(self, service, context, prefill: verifier_pb2.VerifierPrefillRequest, feature_layers: list[int]):
        self.service, self.context = service, context
        self.template = prefill
        self.feature_layers = feature_layers
        self.session_id = prefill.session_id
        self.opened = False
        self.last = 0                        # the last committed token (a root-only tree's root)
        self.verify_wall_s = 0.0             # the last verify's wall time here (forward, checks and hand-overs)
        self.self_drafts = 0                 # cycles whose tree this verifier drafted (lookahead decoding)
        # every feature row sent, while a drafter that needs them may be paired again (``PlaneLoop.pair``)
        self.feature_log: FeatureLog | None = None

    @property
    def sessions(self) -> int:
        return max(1, len(self.service.sessions))

    async def prefill(self, prompt: list[int], sampling, max_new_tokens: int, features: bool) -> Committed:
        request = verifier_pb2.VerifierPrefillRequest()
        request.CopyFrom(self.template)
        request.return_features = features
        request.feature_layers[:] = self.feature_layers if features else []
        response = await self.service.Prefill(request, self.context)
        self.opened, self.last = True, response.token
        self.keep(response.features if features else None)
        return Committed([response.token], [], response.features if features else None,
                         list(response.logprobs) if request.HasField("logprobs") else None,
                         prompt_logprobs=list(response.prompt_logprobs))

    async def verify(self, draft: Draft | None, features: bool) -> Committed:
        depth = draft.tree.depth if draft is not None and isinstance(draft.tree, SelfDraft) else 0
        tree = draft.tree if draft is not None and not depth else \
            common_pb2.DraftTree(tokens=[self.last], parents=[-1])
        start = time.perf_counter()
        response = await self.service.Verify(verifier_pb2.VerifyRequest(
            session_id=self.session_id, tree=tree, return_features=features, lookahead_depth=depth), self.context)
        self.last = response.tokens[-1]
        self.verify_wall_s = time.perf_counter() - start
        self.self_drafts += depth > 0
        self.keep(response.features if features else None)
        return Committed(list(response.tokens), list(response.accepted_nodes),
                         response.features if features else None,
                         list(response.logprobs) if self.template.HasField("logprobs") else None,
                         response.verified_nodes)

    def keep(self, features) -> None:
        if self.feature_log is not None and features is not None:
            self.feature_log.add(features)

    async def release(self) -> None:
        if self.opened:
            self.opened = False
            await self.service.run(self.service.release_session, self.session_id, shield=True)


class PlaneLoop(SpeculativeLoop):
    """The speculative loop that puts a ``RunCommit`` on ``events`` for every commit."""

    def __init__(self, verifier: ServedVerifier, drafter: PairedDrafter | None, request: Request,
                 decoding: Decoding, events: asyncio.Queue, resume: bool, pace: Pace | None = None):
        super().__init__(verifier, drafter, request, decoding, pace=pace)
        self.events = events
        self.resume = resume
        self.cycle: tuple[int, int, bool, int] | None = None     # nodes, accepted, drafted ahead, hops
        self.spent = (0.0, 0.0)                                  # draft-side and verify seconds so far
        self.fallback = ""                                       # why the run had no drafter from the start
        self.paireds = [drafter] if drafter is not None else []  # every drafter paired, in order
        self.pair_to: str | None = None                          # a drafter to pair with before the next cycle
        self.pairing: tuple | None = None                        # (peers, owner, salt, deadline) of new pairs
        if drafter is not None:
            drafter.lost = self.drafter_lost
            if drafter.needs_features:                           # kept for a drafter paired later
                verifier.feature_log = FeatureLog()

    async def prefill(self) -> None:
        if not self.resume:
            return await super().prefill()
        req = self.request          # resuming: the prompt is every committed token, the last one the root
        first = await self.timed("prefill", self.verifier, self.verifier.prefill(
            req.prompt, req.sampling, self.dec.stop.max_new_tokens, self.wants_features))
        if self.drafter is not None and not self.dec.done:
            await self.timed("commit", self.drafter, self.drafter.prefill(req.prompt, first.features, req.sampling))

    @property
    def wants_features(self) -> bool:
        # a drafter that needs features may be paired again: the rows keep coming
        return self.verifier.feature_log is not None or super().wants_features

    def drafter_lost(self, reason: str) -> None:
        self.events.put_nowait(verifier_pb2.RunEvent(drafter_lost=verifier_pb2.RunDrafterLost(reason=reason)))

    async def between_cycles(self) -> None:
        """Pair the drafter the caller named (``RunPair``): it is prefilled with
        every committed token (and feature row) and drafts from the next cycle on."""
        address, self.pair_to = self.pair_to, None
        if address is None or self.drafter is not None or self.pairing is None:
            return
        peers, owner, salt, deadline = self.pairing
        try:
            peer = await peers.get(address)
        except grpc.aio.AioRpcError as exc:
            self.drafter_lost(f"the drafter at {address} did not answer: {exc.code().name} {exc.details()}")
            return
        log_ = self.verifier.feature_log
        if peer.info.needs_features and log_ is None:
            self.drafter_lost(f"the drafter at {address} needs features this run did not keep")
            return
        drafter = PairedDrafter(peers, peer, self.verifier.session_id, owner, salt, deadline)
        drafter.lost = self.drafter_lost
        drafter.ahead_budget = self.paireds[0].ahead_budget if self.paireds else None
        self.paireds.append(drafter)
        self.backends.append(drafter)
        req = self.request
        await self.timed("commit", drafter, drafter.prefill(req.prompt + self.dec.tokens,
                                                            log_.tensor() if log_ is not None else None,
                                                            req.sampling))
        if drafter.alive:
            self.drafter = drafter

    async def commit(self, draft: Draft | None, result: Committed) -> None:
        size = result.nodes or (draft.size if draft is not None else 1)
        asked = draft is not None and not self.hit and not isinstance(draft.tree, SelfDraft)
        self.cycle = (size, len(result.accepted), self.hit, 2 if asked else 0)
        await super().commit(draft, result)

    async def add(self, tokens: list[int], logprobs: list | None = None) -> None:
        start = len(self.dec.tokens)
        final = self.dec.add(tokens, logprobs)
        nodes, accepted, ahead, hops = self.cycle or (0, 0, False, 0)
        self.cycle = None
        t = self.times
        # the drafter's compute and this verifier's: the orchestrator counts the rest of a commit's
        # time (the transport to the drafter and back, and its own) as network, as the relay's does
        spent = (t["draft"] + t["commit"], t["prefill"] + t["verify"])
        msg = verifier_pb2.RunCommit(tokens=final, accepted=accepted, nodes=nodes, ahead=ahead, hops=hops,
                                     draft_s=spent[0] - self.spent[0], verify_s=spent[1] - self.spent[1])
        self.spent = spent
        if logprobs:
            msg.logprobs.extend(self.dec.logprobs[start:start + len(final)])
        if not start and self.dec.prompt_logprobs:
            msg.prompt_logprobs.extend(self.dec.prompt_logprobs)
        self.events.put_nowait(verifier_pb2.RunEvent(commit=msg))

    def summary(self) -> verifier_pb2.RunDone:
        paired = self.paireds
        fallback = next((p.fallback for p in reversed(paired) if p.fallback), self.fallback)
        return verifier_pb2.RunDone(
            finish_reason=self.dec.finish_reason or "",
            fallback=fallback if self.drafter is None else "",
            drafts=sum(p.drafts for p in paired) + self.verifier.self_drafts, ahead_hits=self.dec.stats.ahead_hits,
            ahead_draft_s=sum(p.ahead_s for p in paired), wire_bytes=sum(p.wire_bytes for p in paired))


async def first_message(requests: AsyncIterator) -> verifier_pb2.RunStart:
    async for message in requests:
        if message.WhichOneof("step") != "start":
            raise InvalidArgument(f"a run opens with start, got {message.WhichOneof('step')}")
        return message.start
    raise InvalidArgument("a run opens with start, got nothing")


async def watch(requests: AsyncIterator, loop: PlaneLoop) -> None:
    """Read the caller's later messages: a stop ends the run after the cycle in
    flight, a pair names the drafter to go on with."""
    decoding = loop.dec
    async for message in requests:
        step = message.WhichOneof("step")
        if step == "pair" and message.pair.drafter:
            loop.pair_to = message.pair.drafter
            continue
        if step != "stop":
            decoding.finish_reason = decoding.finish_reason or "stopped"
            raise InvalidArgument(f"a run takes one start, then stops and pairs with a drafter, got {step}")
        if not decoding.done:
            decoding.finish_reason = "stopped"


def check_start(start: verifier_pb2.RunStart, vocab_size: int) -> tuple:
    """(tree knobs or None, lookahead, verify budget, min_tau, EOS ids) of a ``RunStart``; names a bad field."""
    tree = wire.tree_request_from_proto(start.tree).resolve(TreeParams()) if start.HasField("tree") else None
    lookahead = check_count(start.lookahead, "lookahead")
    if lookahead > MAX_LOOKAHEAD:
        raise InvalidArgument(f"lookahead must be in [0, {MAX_LOOKAHEAD}], got {lookahead}")
    budget = check_count(start.verify_token_budget, "verify_token_budget", note="0 = off")
    if not start.min_tau >= 0:
        raise InvalidArgument(f"min_tau must be >= 0 (0 = always draft), got {start.min_tau}")
    eos = frozenset(start.eos_token_ids)
    bad = [t for t in eos if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"eos_token_ids: {bad[0]} is not in [0, {vocab_size})")
    return tree, lookahead, budget, float(start.min_tau), eos


async def run(service, requests: AsyncIterator, context) -> AsyncIterator[verifier_pb2.RunEvent]:
    """The Run RPC of ``service`` (a loaded ``VerifierService``)."""
    start = await first_message(requests)
    service.check(opens_session=True)
    prefill = start.prefill
    tree, lookahead, budget, min_tau, eos = check_start(start, service.engine.target.vocab_size)
    sampling = wire.sampling_from_proto(prefill.sampling)
    remaining = context.time_remaining() if context is not None else None
    drafter, unreached = None, ""
    if start.drafter and tree is not None and tree.method != LOOKAHEAD:
        try:
            peer = await service.peers.get(start.drafter)
        except grpc.aio.AioRpcError as exc:     # no drafter to pair with: plain decoding, the same output
            unreached = f"the drafter at {start.drafter} did not answer: {exc.code().name} {exc.details()}"
            log.warning("paired drafter unreachable, going on with plain decoding",
                        extra={"session": prefill.session_id, "error": unreached})
        else:
            drafter = PairedDrafter(service.peers, peer, prefill.session_id, prefill.owner,
                                    start.drafter_cache_salt, remaining)
    verifier = ServedVerifier(service, context, prefill, drafter.feature_layers if drafter is not None else [])
    if drafter is not None and not start.ahead_unbudgeted:
        # what drafting ahead hides behind is the verify as this loop waits for it, as the relay's
        # orchestrator times it (there with the transport too): the forward, the handler's checks
        # and its hand-overs to the engine's thread (~1.4 ms a cycle on the demo family)
        drafter.ahead_budget = lambda: AHEAD_BUDGET_SHARE * verifier.verify_wall_s
    prompt = list(prefill.prompt_ids)
    decoding = Decoding(StopCriteria(max(prefill.max_new_tokens, 0), eos), min_tau, prior=start.min_tau_prior)
    request = Request(prompt=prompt, sampling=sampling, tree=tree, lookahead=lookahead, verify_token_budget=budget)
    events: asyncio.Queue = asyncio.Queue()
    # greedy sessions paired with the same drafter and knobs (tree, drafting ahead, budget) share what their cycles cost
    pace = service.paces.of(start.drafter, *knobs_key(tree, lookahead, budget)) if drafter is not None else None
    loop = PlaneLoop(verifier, drafter, request, decoding, events, prefill.resume, pace)
    loop.fallback = unreached
    if start.drafter and tree is not None and tree.method != LOOKAHEAD:
        loop.pairing = (service.peers, prefill.owner, start.drafter_cache_salt, remaining)

    async def drive() -> None:
        try:
            await loop.run()
        finally:
            events.put_nowait(None)

    task = asyncio.ensure_future(drive())
    watcher = asyncio.ensure_future(watch(requests, loop))
    try:
        while (event := await events.get()) is not None:
            yield event
        await task
        if watcher.done() and watcher.exception() is not None:
            raise watcher.exception()
        yield verifier_pb2.RunEvent(done=loop.summary())
        await watcher               # until the caller half-closes: the handler ends, not abandoned mid-stream
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
