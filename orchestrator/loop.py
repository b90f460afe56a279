"""One generation over gRPC: the speculative loop (``specdec.request.speculative``)
on the verifier and drafter the router pins the request to.

Per request (a session, the same id on both services):
  0. pin the session to the least loaded verifier and, for drafting, drafter
     (``orchestrator.routing``); no free verifier: RESOURCE_EXHAUSTED, none
     reachable: UNAVAILABLE; no free drafter: plain decoding;
  1. the loop: Verifier.Prefill -> first token (+ prompt features for an EAGLE
     drafter), Drafter.Prefill with prompt + first token, then cycles of
     Drafter.Draft (carrying the tokens and features committed since: one
     drafter round trip per cycle) -> Verifier.Verify (which commits the
     accepted path) -> ``Decoding.add`` (EOS, max_new_tokens, stop strings),
     streaming what became final; with lookahead (greedy sessions) the
     drafter drafts the next round (DraftAhead) while the verifier verifies;
  2. Release on both services, whatever happened (shielded from cancellation).

Each backend's per-cycle steps travel on one session stream
(``orchestrator.backend``; ``streams=False``: a unary call per step).
On the direct plane (``direct``, ``orchestrator.plane``) the pinned verifier
runs the loop itself and calls the pinned drafter directly; this side opens
the run with the request's policy, hears every commit and sends stops.

The verifier and drafter are ``orchestrator.failover``'s handles: losing a
backend costs a re-prefill, never a token. Features travel from verifier to
drafter as the verifier's ``Tensor`` message, untouched.

Time split per request (``draft_s + verify_s + network_s + other_s =
wall_s``): draft_s / verify_s are the compute times the services report (the
whole call where a response carries none: drafter prefill), network_s the
rest of each call's wall time (transport, serialization, queueing, calls
that failed) and other_s the orchestrator's own work (tokenizer, stream
writes).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from specdec.request import knobs
from specdec.request.decoding import Decoding
from specdec.request.pace import Pace, knobs_key
from specdec.request.params import LOOKAHEAD, SamplingParams, TreeParams
from specdec.request.speculative import Request, speculative_generate
from specdec.serving import metrics
from orchestrator.backend import Deadline
from orchestrator.failover import RemoteDrafter, RemoteVerifier
from orchestrator.plane import DirectRun
from orchestrator.routing import Endpoint, Router
from orchestrator.text import Delta, TextStream

__all__ = ["Deadline", "Generation", "Job"]

# Drafting ahead may take this share of the last verify's wall time: the trees
# come back before the verify does (the drafter answers once it is past it).
AHEAD_BUDGET_SHARE = 0.9


@dataclass(frozen=True)
class Job:
    """A validated request with this server's defaults applied (protos are the
    gRPC handles' business: ``orchestrator.failover``)."""

    session_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams          # seed always set
    tree: TreeParams | None           # explicit knobs; None: root-only trees
    logprobs: int | None = None       # top alternatives per token's logprob; None: no logprobs
    prompt_logprobs: int | None = None  # the same for the prompt's tokens but the first
    cache_salt: str = ""              # the backends' prefix caches share blocks within one salt only


class Generation:
    """Runs one Job on the backends the router gives it, feeding a Decoding and a TextStream."""

    def __init__(self, router: Router, job: Job, decoding: Decoding, text: TextStream, deadline: Deadline,
                 verify_token_budget: int = 0, lookahead: int = 0, gate_by_kind: bool = False,
                 streams: bool = True, ahead_budget: bool = True, direct: bool = False):
        self.job = job
        self.router = router
        self.dec = decoding
        self.text = text
        self.gate_by_kind = gate_by_kind    # the gate's min_tau follows the first pinned drafter's kind
        self.request = Request(prompt=list(job.prompt_ids), sampling=job.sampling, tree=job.tree,
                               lookahead=lookahead, verify_token_budget=verify_token_budget)
        self.remote_verifier = RemoteVerifier(router.verifiers, job.session_id, deadline, router.leases,
                                              job.logprobs, streams, job.prompt_logprobs, job.cache_salt)
        # lookahead decoding drafts on the verifier: no drafter is pinned (the loop's ``SelfDrafter``)
        self.remote_drafter = (RemoteDrafter(router.drafters, job.session_id, deadline, router.leases, streams,
                                             job.cache_salt)
                               if job.tree is not None and job.tree.method != LOOKAHEAD
                               else None)
        if self.remote_drafter is not None and ahead_budget:
            # drafting ahead fits in about the last verify's time (0: the first cycle, no limit)
            self.remote_drafter.ahead_budget = lambda: AHEAD_BUDGET_SHARE * self.remote_verifier.verify_wall_s
        self.ahead_budget = ahead_budget     # drafting ahead fits in the last verify's time
        self.direct = DirectRun(self) if direct else None   # the direct plane (``orchestrator.plane``)
        self.emit: Callable[[Delta], Awaitable[None]] | None = None
        self.first_token_seen = False
        self.last_emit: float | None = None

    async def run(self, emit: Callable[[Delta], Awaitable[None]]) -> None:
        self.emit = emit
        drafter = await self.pin()
        if self.direct is not None:
            self.direct.drafter = drafter
            await self.direct.run()
            self.dec.finish()
        else:
            await speculative_generate(self.remote_verifier, drafter, self.request, self.dec, listener=self,
                                       pace=self.pace(drafter))
        await self.send(self.text.finish())

    async def pin(self) -> RemoteDrafter | None:
        """Pin the session to a verifier and a drafter; None: no drafting (plain decoding)."""
        try:
            await self.remote_verifier.pin()
            if self.gate_by_kind and self.job.tree is not None and self.job.tree.method == LOOKAHEAD:
                self.dec.gate.min_tau = knobs.default_min_tau(LOOKAHEAD)
            if self.remote_drafter is None or not await self.remote_drafter.pin(first=True):
                return None
            # the verifier returns the features from the layers this drafter reads
            self.remote_verifier.feature_layers = self.remote_drafter.feature_layers
        except BaseException:
            await asyncio.shield(self.release())
            raise
        if self.gate_by_kind:
            self.dec.gate.min_tau = knobs.default_min_tau(self.remote_drafter.kind)
        return self.remote_drafter

    def pace(self, drafter: RemoteDrafter | None) -> Pace | None:
        """What cycles cost on the pinned verifier–drafter pair, shared by its greedy sessions."""
        if drafter is None or drafter.endpoint is None or self.remote_verifier.endpoint is None:
            return None
        return self.router.paces.of(self.remote_verifier.endpoint.address, drafter.endpoint.address,
                                    *knobs_key(self.job.tree, self.request.lookahead,
                                              self.request.verify_token_budget))

    async def release(self) -> None:
        handles = [h for h in (self.remote_verifier, self.remote_drafter) if h is not None]
        await asyncio.gather(*(h.release() for h in handles))

    # -- what the loop tells (speculative.Listener) ------------------------------------------
    async def committed(self, tokens: list[int]) -> None:
        if not self.first_token_seen and self.dec.tokens:
            self.first_token_seen = True
            metrics.TTFT.observe(self.dec.stats.ttft_s)
        await self.send(self.text.take())

    def drafted_ahead(self, hit: bool) -> None:
        metrics.AHEAD_CYCLES.labels("hit" if hit else "miss").inc()

    async def send(self, delta: Delta) -> None:
        if not delta.token_ids and not delta.text:
            return
        now = time.perf_counter()
        if self.last_emit is not None and delta.token_ids:
            per_token = (now - self.last_emit) / len(delta.token_ids)
            for _ in delta.token_ids:
                metrics.INTER_TOKEN_LATENCY.observe(per_token)
        if delta.token_ids:
            self.last_emit = now
        await self.emit(delta)

    # -- what the service reports ------------------------------------------------------------
    @property
    def verifier(self) -> Endpoint | None:
        return self.remote_verifier.endpoint

    @property
    def drafter(self) -> Endpoint | None:
        return self.remote_drafter.endpoint if self.remote_drafter is not None else None

    @property
    def drafts(self) -> int:
        """Cycles that asked the drafter for a tree (lookahead decoding: the verifier)."""
        if self.direct is not None:
            return self.direct.drafts
        return self.remote_drafter.drafts if self.remote_drafter is not None else self.remote_verifier.self_drafts

    @property
    def wire_bytes(self) -> int:
        """Serialized bytes of this request's backend calls, requests and answers."""
        if self.direct is not None:
            return self.direct.wire_bytes
        return sum(h.wire_bytes for h in (self.remote_verifier, self.remote_drafter) if h is not None)

    @property
    def ahead_draft_s(self) -> float:
        """Drafter compute this request spent drafting one round ahead."""
        if self.direct is not None:
            return self.direct.ahead_s
        return self.remote_drafter.ahead_s if self.remote_drafter is not None else 0.0

    @property
    def moves(self) -> dict[str, int]:
        return {"verifier": self.remote_verifier.moves,
                "drafter": self.remote_drafter.moves if self.remote_drafter is not None else 0}

    def timing(self) -> dict[str, float]:
        """draft_s, verify_s, network_s, other_s; they add up to wall_s."""
        t = self.dec.stats.time_s
        split = {"draft_s": t["draft"] + t["commit"], "verify_s": t["prefill"] + t["verify"],
                 "network_s": t["network"]}
        split["other_s"] = max(0.0, self.dec.stats.wall_s - sum(split.values()))
        return split
