"""One generation on the direct plane: the verifier runs the loop and talks to
the drafter itself; the orchestrator manages it from off the critical path.

The orchestrator pins a verifier and a drafter (``orchestrator.routing``, as
for the relayed loop), then opens the verifier's Run stream with the
request's standing policy (``RunStart``: the session's prefill, the paired
drafter's address, the tree knobs, drafting ahead, the verify budget, the
speculation gate's threshold, the EOS ids). Trees and features then travel
between verifier and drafter only (``verifier.plane``); each commit comes
back here on the Run stream, into the request's ``Decoding`` (EOS,
max_new_tokens, stop strings, which only the orchestrator can detokenize)
and on to the caller. A stop the orchestrator finds (a stop string) goes back
as ``RunStop``: the verifier ends after the cycle in flight, and what it
committed past the stop is never shown. Cancelling the request cancels the
stream, which releases the session on both backends.

Failover: a verifier lost mid-run (the stream breaks with UNAVAILABLE or
NOT_FOUND) is replaced by another one, started with ``resume`` on the
committed tokens (the prompt and every token this orchestrator has), which
re-prefills the same drafter from them; with none left the request fails
UNAVAILABLE. A lost drafter is the verifier's to notice: it goes on with
plain decoding and says so (``RunDrafterLost``); the orchestrator pins
another drafter, as the relayed loop's failover would, and pairs the run
with it (``RunPair``): the verifier prefills it with every committed token
and feature row and drafts there from the next cycle. The output is the one
an undisturbed run gives (greedy), or a sample of the same distribution.

Leases: both sessions are opened under this orchestrator's lease (the
verifier passes the owner on to the drafter), so a dead orchestrator leaves
nothing behind either way.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from specdec.request import wire
from specdec.request.params import LOOKAHEAD
from specdec.v1 import verifier_pb2
from orchestrator.backend import BackendError

log = logging.getLogger("specdec.orchestrator")

RELAY, DIRECT = "relay", "direct"       # the data planes an orchestrator runs requests on
PLANES = (RELAY, DIRECT)


class DirectRun:
    """Runs a ``Generation``'s request on the direct plane (``Generation.run`` with ``direct``)."""

    def __init__(self, gen):
        self.gen = gen
        self.verifier = gen.remote_verifier
        self.drafter = None                 # the pinned RemoteDrafter (None: no drafting), set by ``Generation.pin``
        self.dec = gen.dec
        self.wire_bytes = 0
        self.drafts = 0
        self.ahead_s = 0.0
        # this run's span between commits and the compute its verifier reported in it: the network
        # is what the one leaves of the other over the run (a commit read late makes the next gap
        # shorter than its compute: per commit, the two would not add up)
        self.span_s = self.compute_s = self.network_before = 0.0

    async def run(self) -> None:
        v = self.verifier
        try:
            while True:
                try:
                    await self.one_run()
                    return
                except BackendError as exc:
                    if self.dec.done:       # the run broke after the request had all it wanted
                        return
                    await v.leave(exc, opening=not v.opened)
        finally:
            await asyncio.shield(self.gen.release())

    async def one_run(self) -> None:
        """One Run stream on the pinned verifier, from start (or resume) to its summary."""
        v, job, dec = self.verifier, self.gen.job, self.dec
        resume = v.opened
        start = self.start(resume)
        v.leases.hold(v.endpoint, job.session_id)
        v.sent_prefill = True                   # it may hold the session until the run ends cleanly
        if self.drafter is not None and self.drafter.endpoint is not None:
            self.drafter.leases.hold(self.drafter.endpoint, job.session_id)
            self.drafter.sent_prefill = True
        stream = v.endpoint.stub.Run(timeout=v.deadline.remaining())
        stopped = False
        try:
            # the span opens before the start goes out: the verifier's first step may begin before
            # the write returns, and its compute must lie inside the span it is taken from
            self.span_s = self.compute_s = 0.0
            self.network_before = dec.stats.time_s["network"]
            last = time.perf_counter()
            await stream.write(verifier_pb2.RunRequest(start=start))
            self.wire_bytes += start.ByteSize()
            while True:
                event = await stream.read()
                if event == grpc.aio.EOF:
                    raise BackendError("verifier", "Run", grpc.StatusCode.UNAVAILABLE,
                                       "the run ended without its summary", v.endpoint.address)
                self.wire_bytes += event.ByteSize()
                step = event.WhichOneof("step")
                if step == "done":
                    self.finished(event.done)
                    break
                if step == "drafter_lost":
                    await self.repair(stream, event.drafter_lost.reason)
                    continue
                now = time.perf_counter()
                await self.committed(event.commit, now - last, resume)
                last = now
                if dec.done and not stopped:
                    stopped = True
                    await stream.write(verifier_pb2.RunRequest(stop=verifier_pb2.RunStop()))
            await stream.done_writing()
        except grpc.aio.AioRpcError as exc:
            raise v.failure("Run", exc) from None
        except asyncio.InvalidStateError:       # the call ended between reads: its status is the failure
            code, details = await stream.code(), await stream.details()
            raise BackendError("verifier", "Run", grpc.StatusCode.UNAVAILABLE if code == grpc.StatusCode.OK
                               else code, details or "the run had ended", v.endpoint.address) from None
        finally:
            if not stream.done():
                stream.cancel()

    def start(self, resume: bool) -> verifier_pb2.RunStart:
        """The run's standing policy; resuming: the committed tokens are the prompt."""
        v, job, dec, req = self.verifier, self.gen.job, self.dec, self.gen.request
        prompt = list(job.prompt_ids)
        prefill = verifier_pb2.VerifierPrefillRequest(
            session_id=job.session_id, prompt_ids=prompt + dec.tokens if resume else prompt,
            sampling=wire.sampling_to_proto(job.sampling), max_new_tokens=dec.stop.max_new_tokens - len(dec.tokens),
            resume=resume, owner=v.leases.owner, logprobs=job.logprobs, prompt_tokens=len(prompt) if resume else 0,
            prompt_logprobs=None if resume else job.prompt_logprobs, cache_salt=job.cache_salt)
        start = verifier_pb2.RunStart(prefill=prefill, lookahead=req.lookahead,
                                      verify_token_budget=req.verify_token_budget, min_tau=dec.gate.min_tau,
                                      eos_token_ids=sorted(dec.stop.eos_ids), drafter_cache_salt=job.cache_salt,
                                      ahead_unbudgeted=not self.gen.ahead_budget, min_tau_prior=dec.gate.prior)
        if req.tree is not None:
            start.tree.CopyFrom(wire.tree_params_to_proto(req.tree))
            drafted = self.drafter is not None and self.drafter.endpoint is not None
            if drafted and req.tree.method != LOOKAHEAD:
                start.drafter = self.drafter.endpoint.address
        return start

    async def committed(self, msg: verifier_pb2.RunCommit, wall_s: float, resume: bool) -> None:
        """One commit of the run into the decoding, and on to the caller."""
        v, job, dec, stats = self.verifier, self.gen.job, self.dec, self.dec.stats
        first = not v.opened
        v.opened = True
        t = stats.time_s
        t["prefill" if first else "verify"] += msg.verify_s
        t["commit" if first else "draft"] += msg.draft_s
        self.span_s += wall_s
        self.compute_s += msg.verify_s + msg.draft_s
        t["network"] = self.network_before + max(0.0, self.span_s - self.compute_s)
        tokens = list(msg.tokens)
        if msg.nodes:
            stats.record_cycle(msg.nodes, msg.accepted)
            stats.ahead_hits += msg.ahead
            stats.ahead_committed += len(tokens) if msg.ahead else 0
            if msg.ahead:
                self.gen.drafted_ahead(True)
        if first and not resume and job.prompt_logprobs is not None:
            dec.prompt_logprobs = wire.logprobs_from_proto(msg.prompt_logprobs)
        logprobs = wire.logprobs_from_proto(msg.logprobs) if job.logprobs is not None else None
        final = dec.add(tokens, logprobs)
        v.committed = [*job.prompt_ids, *dec.tokens]
        await self.gen.committed(final)

    async def repair(self, stream, reason: str) -> None:
        """The paired drafter failed: pin another one (``RemoteDrafter.leave``: the
        same rules as the relay's failover) and pair the run with it; none left:
        the run goes on as plain decoding."""
        d, sid = self.drafter, self.gen.job.session_id
        if d is None or d.endpoint is None or self.dec.done:
            return
        lost = BackendError("drafter", "Draft", grpc.StatusCode.UNAVAILABLE, reason, d.endpoint.address)
        if not await d.leave(lost, opening=False):
            return
        d.leases.hold(d.endpoint, sid)
        d.sent_prefill = True
        await stream.write(verifier_pb2.RunRequest(pair=verifier_pb2.RunPair(drafter=d.endpoint.address)))

    def finished(self, done: verifier_pb2.RunDone) -> None:
        """The run's summary: the sessions are released on both backends."""
        v, d, sid = self.verifier, self.drafter, self.gen.job.session_id
        self.drafts += done.drafts
        self.ahead_s += done.ahead_draft_s
        self.wire_bytes += done.wire_bytes
        v.sent_prefill = False
        v.leases.drop(v.endpoint, sid)
        if d is not None and d.endpoint is not None:
            d.sent_prefill = False
            d.leases.drop(d.endpoint, sid)
        if done.fallback:
            log.warning("the paired drafter failed; the verifier went on with plain decoding",
                        extra={"session": sid, "error": done.fallback})
