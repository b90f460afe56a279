"""OrchestratorService: the public API (``Generate`` streams, ``Complete`` returns the whole).

The servicer converts a request once (``specdec.request.wire`` into a validated
``specdec.request.params.GenerationRequest``: INVALID_ARGUMENT naming the field, before
any backend is called), applies this server's defaults and limits, tokenizes
it, runs ``orchestrator.loop.Generation`` (one per choice) on the verifier and
drafter the ``orchestrator.routing.Router`` pins it to, and translates chunks
and statistics into messages. It owns what the services must agree on:
session ids (uuid4), seeds (one is drawn when the request has none, and sent
to the verifier), tree knobs (request, else this server's defaults
``OrchestratorConfig.tree``, clamped to the pinned drafter's limits) and the deadline, passed down as the timeout
of every internal call. A client cancel or an expired deadline cancels the
handler; the loop's ``finally`` releases both sessions. ``generate`` is that
path as a public call, taking a validated request: the gRPC handlers and the
HTTP API (``orchestrator.http``, in the same process) both use it.

Readiness: ``connect`` returns once a verifier answers GetInfo (which it does
only when loaded) and, if drafters are configured, a drafter too, or
``DRAFTER_WAIT_S`` later without one (requests then run as plain decoding
until a drafter shows up). From then on the router re-resolves and probes the
backends in the background.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Awaitable, Callable, Sequence

from specdec.request import wire
from specdec.request.decoding import Decoding, StopCriteria
from specdec.request.errors import InvalidArgument, Unavailable
from specdec.request.params import (LOOKAHEAD, VANILLA, ChatMessage, GenerationRequest, TreeParams, backend_salt,
                                    choice_seed)
from specdec.serving import metrics
from specdec.serving.logs import request_id_var
from specdec.serving.server import ClientTls, Lifecycle, status_code_of
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc, verifier_pb2
from orchestrator.loop import Deadline, Generation, Job
from orchestrator.plane import DIRECT, PLANES, RELAY
from orchestrator.routing import Discovery, Resolver, Router, parse_addresses, resolve_dns, split_address
from orchestrator.text import Delta, TextStream, TextTokenizer

log = logging.getLogger("specdec.orchestrator")

SERVICE_NAME = orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"].full_name
DRAFTER_WAIT_S = 60.0          # readiness waits this long for a drafter once a verifier answers
# Renders a request's chat messages into the prompt text (the model's chat template).
ChatRenderer = Callable[[Sequence[ChatMessage]], str]


@dataclass(frozen=True)
class OrchestratorConfig:
    """Backends: static HOST:PORT lists (a string may hold several, comma-separated)
    and / or the DNS names (HOST:PORT) of headless Services, re-resolved every
    ``resolve_interval_s``. No drafter at all: plain decoding on the verifiers."""

    verifier: str | tuple[str, ...] = ()
    drafter: str | tuple[str, ...] | None = None
    verifier_dns: str | None = None
    drafter_dns: str | None = None
    resolve_interval_s: float = 10.0
    probe_interval_s: float = 2.0                  # GetInfo on every backend (health, capacity)
    tree: TreeParams = TreeParams()                # knobs a request leaves unset (static_shape unused)
    default_max_new_tokens: int = 128              # for requests that leave it at 0
    max_new_tokens_limit: int = 2048
    backend_tls: ClientTls | None = None
    backend_token: str | None = None
    # >0: tree nodes one verifier step should carry over all its sessions; each
    # session's tree is cut to budget / sessions on that verifier (at least
    # MIN_SHARED_TREE): under load a wide tree mostly verifies rejected tokens.
    verify_token_budget: int = 0
    # SpeculationGate: pause drafting below this recent τ (0 = always draft;
    # None: by the pinned drafter's kind, ``knobs.default_min_tau``)
    min_tau: float | None = 0.0
    # greedy sessions: accepted paths the drafter drafts the next round for while
    # the verifier checks the current tree (0 = off; ``Drafter.draft_ahead``)
    lookahead: int = 0
    # per-cycle backend steps on one bidirectional stream per session (False: unary calls)
    session_streams: bool = True
    # drafting ahead stops starting paths past the last verify's time (False: all `lookahead` paths)
    lookahead_budget: bool = True
    # DIRECT: the verifier runs each request's loop with the drafter it is paired with
    # (``orchestrator.plane``); RELAY: trees and commits travel through this orchestrator
    # (the plane of unary steps, and of verifiers that may not reach the drafters)
    plane: str = DIRECT

    def __post_init__(self):
        object.__setattr__(self, "verifier", parse_addresses(self.verifier))
        object.__setattr__(self, "drafter", parse_addresses(self.drafter))
        for name in ("verifier_dns", "drafter_dns"):
            value = getattr(self, name) or None
            if value is not None:
                split_address(value)
            object.__setattr__(self, name, value)
        if not self.verifier and not self.verifier_dns:
            raise ValueError("no verifier: give at least one verifier address or a verifier DNS name")
        for name in ("resolve_interval_s", "probe_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name.replace('_', ' ')} must be > 0, got {getattr(self, name)}")
        if self.max_new_tokens_limit < 1:
            raise ValueError(f"max_new_tokens limit must be >= 1, got {self.max_new_tokens_limit}")
        if self.min_tau is not None and not self.min_tau >= 0:
            raise ValueError(f"min tau must be >= 0 (0 = always draft), got {self.min_tau}")
        if isinstance(self.lookahead, bool) or not isinstance(self.lookahead, int) or not 0 <= self.lookahead <= 8:
            raise ValueError(f"lookahead must be an integer in [0, 8] (0 = off), got {self.lookahead}")
        if isinstance(self.verify_token_budget, bool) or not self.verify_token_budget >= 0:
            raise ValueError(f"verify token budget must be >= 0 (0 = off), got {self.verify_token_budget}")
        if self.plane not in PLANES:
            raise ValueError(f"plane must be one of {', '.join(PLANES)}, got {self.plane!r}")
        if self.plane == DIRECT and not self.session_streams:
            raise ValueError("unary steps go through the orchestrator: they need the relay plane")
        if self.default_max_new_tokens < 1:
            raise ValueError(f"default max_new_tokens must be >= 1, got {self.default_max_new_tokens}")

    @property
    def verifiers(self) -> Discovery:
        return Discovery(self.verifier, self.verifier_dns)

    @property
    def drafters(self) -> Discovery:
        return Discovery(self.drafter, self.drafter_dns)


@dataclass(frozen=True)
class GenerationResult:
    """A finished choice: the output (cut at a stop string), its statistics
    and its tokens' logprobs (``specdec.request.params.TokenLogprob``; none unless
    asked for); the prompt's token ids and, when asked for, the logprobs of
    each but the first (``prompt_logprobs``)."""

    text: str
    token_ids: list[int]
    stats: orchestrator_pb2.GenerationStats
    logprobs: list = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)


# What a generation hears as it runs: (choice index, a final chunk, its tokens' logprobs).
Emit = Callable[[int, Delta, list], Awaitable[None]]


class OrchestratorService(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    role = "orchestrator"

    def __init__(self, config: OrchestratorConfig, tokenizer: TextTokenizer, resolver: Resolver = resolve_dns,
                 chat_renderer: ChatRenderer | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.chat_renderer = chat_renderer   # None: requests with messages are refused
        self.resolver = resolver             # DNS lookups (HOST, PORT) -> [HOST:PORT]
        self.lifecycle = Lifecycle()
        self.lifecycle.busy = lambda: self.active > 0
        self.active = 0
        self.stats = metrics.SessionStats(self.role)
        self.router: Router | None = None
        self.verifier_info: verifier_pb2.VerifierGetInfoResponse | None = None

    def registration(self) -> tuple[Callable, object, str]:
        return orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server, self, SERVICE_NAME

    # -- backends -------------------------------------------------------------------------
    async def connect(self, retry_s: float = 0.5, drafter_wait_s: float = DRAFTER_WAIT_S) -> None:
        """Wait until a verifier (and a drafter, for up to ``drafter_wait_s``)
        answers GetInfo, check the tokenizer fits, keep the backends current."""
        cfg = self.config
        router = Router(cfg.verifiers, cfg.drafters, cfg.backend_tls, cfg.backend_token,
                        cfg.resolve_interval_s, cfg.probe_interval_s, self.resolver)
        self.router = router
        waiting_since = time.monotonic()
        last_note = 0.0
        while True:
            await router.refresh()
            waited = time.monotonic() - waiting_since
            verifiers = router.verifiers.usable()
            drafters_missing = cfg.drafters.configured and not router.drafters.usable()
            drafters = list(router.drafters.endpoints.values())
            misfits = [e for e in drafters if e.problem]
            if verifiers and drafters_missing and misfits and len(misfits) == len(drafters):
                raise ValueError(f"drafter at {misfits[0].address} has a {misfits[0].problem}")
            if verifiers and not (drafters_missing and waited < drafter_wait_s):
                break
            if waited - last_note >= 10.0 or last_note == 0.0:
                last_note = max(waited, 1e-9)
                log.info("waiting for backends", extra={"verifiers": cfg.verifiers.describe(),
                                                        "drafters": cfg.drafters.describe(),
                                                        "waiting_for": "a drafter" if verifiers else "a verifier"})
            await asyncio.sleep(retry_s)
        vinfo = verifiers[0].info
        if self.tokenizer.vocab_size > vinfo.vocab_size:
            raise ValueError(f"the tokenizer has {self.tokenizer.vocab_size} tokens, more than the verifier's "
                             f"vocabulary of {vinfo.vocab_size}")
        if drafters_missing:
            log.warning("no drafter answered: plain decoding until one does",
                        extra={"drafters": cfg.drafters.describe()})
        self.verifier_info = vinfo
        router.start()
        log.info("backends ready", extra={
            "model": vinfo.model, "verifiers": [e.address for e in verifiers],
            "drafters": [e.address for e in router.drafters.usable()]})

    async def aclose(self) -> None:
        if self.router is not None:
            await self.router.aclose()
        self.stats.close()

    # -- RPCs -----------------------------------------------------------------------------
    async def Generate(self, request, context):
        """Chunks as tokens are committed (choices interleaved, each chunk naming
        its choice), then one final stats message per choice, in order. The
        choices run concurrently and a stream takes one write at a time.
        Prompt logprobs are Complete's only (a stream carries generated tokens)."""
        if request.HasField("prompt_logprobs"):
            metrics.REQUESTS.labels("INVALID_ARGUMENT").inc()
            raise InvalidArgument("prompt_logprobs: Generate streams generated tokens only; ask Complete for them")
        writing = asyncio.Lock()

        async def emit(index: int, delta: Delta, logprobs: list) -> None:
            chunk = orchestrator_pb2.TokenChunk(token_ids=delta.token_ids, text=delta.text, index=index,
                                                logprobs=wire.logprobs_to_proto(logprobs))
            async with writing:
                await context.write(orchestrator_pb2.GenerateResponse(chunk=chunk))

        results = await self._serve(request, context, emit)
        for result in results:
            await context.write(orchestrator_pb2.GenerateResponse(final=result.stats))

    async def Complete(self, request, context):
        async def emit(index: int, delta: Delta, logprobs: list) -> None:
            return None

        results = await self._serve(request.request, context, emit)
        choices = [orchestrator_pb2.Choice(index=i, text=r.text, token_ids=r.token_ids,
                                           logprobs=wire.logprobs_to_proto(r.logprobs), stats=r.stats)
                   for i, r in enumerate(results)]
        first = choices[0]
        response = orchestrator_pb2.CompleteResponse(text=first.text, token_ids=first.token_ids, stats=first.stats,
                                                     logprobs=first.logprobs, choices=choices)
        if request.request.HasField("prompt_logprobs"):
            response.prompt_ids.extend(results[0].prompt_ids)
            response.prompt_logprobs.extend(wire.logprobs_to_proto(results[0].prompt_logprobs))
        return response

    async def _serve(self, msg, context, emit: Emit) -> list[GenerationResult]:
        try:
            request = wire.generation_request_from_proto(msg, self.config.max_new_tokens_limit)
        except InvalidArgument:
            metrics.REQUESTS.labels("INVALID_ARGUMENT").inc()
            raise
        return await self.generate(request, emit, context.time_remaining(), bearer_token(context))

    async def generate(self, request: GenerationRequest, emit: Emit,
                       timeout: float | None = None, tenant: str = "") -> list[GenerationResult]:
        """Run one validated request to its end, its ``n`` choices concurrently
        (each its own sessions), passing each final chunk to ``emit`` with its
        choice and its tokens' logprobs: the one generation path of every
        public API (the gRPC handlers above, the HTTP API of
        ``orchestrator.http``). Returns the choices in order. Errors are
        raised as ``SpecdecError``s (their ``code`` is the status); the first
        failing choice cancels the others; cancelling the caller's task stops
        the generations and releases their sessions. ``tenant``: the caller's
        bearer token ("" for none); with the request's ``cache_salt`` it
        decides which cached prompt prefixes the backends may reuse for it
        (``specdec.request.params.backend_salt``)."""
        start = time.perf_counter()
        status = "OK"
        gens: list[Generation] = []
        deadline = Deadline(timeout)
        self.active += 1
        self.stats.update(self.active)
        try:
            if request.request_id:
                request_id_var.set(request.request_id)
            if self.verifier_info is None:
                raise Unavailable("not ready: waiting for a verifier")
            self.lifecycle.check(opens_session=True)
            gens = self._prepare(request, deadline, backend_salt(tenant, request.cache_salt))
            await run_all([gen.run(partial(choice_emit, emit, i, gen)) for i, gen in enumerate(gens)])
            for gen in gens:
                gen.dec.finish()
            return [GenerationResult(gen.text.text, list(gen.dec.tokens), self._stats(gen, i), list(gen.dec.logprobs),
                                     gen.job.prompt_ids, list(gen.dec.prompt_logprobs))
                    for i, gen in enumerate(gens)]
        except asyncio.CancelledError:
            status = "DEADLINE_EXCEEDED" if _expired(deadline) else "CANCELLED"
            raise
        except Exception as exc:              # the caller answers it (the gRPC interceptor, the HTTP layer)
            status = status_code_of(exc).name
            raise
        finally:
            self.active -= 1
            self.stats.update(self.active)
            metrics.REQUESTS.labels(status).inc()
            metrics.REQUEST_DURATION.observe(time.perf_counter() - start)
            for gen in gens:
                self._count(gen, status)

    # -- requests -------------------------------------------------------------------------
    def _prepare(self, request: GenerationRequest, deadline: Deadline, salt: str = "") -> list[Generation]:
        """Apply this server's defaults and limits, tokenize; INVALID_ARGUMENT
        names the field. One generation per choice: choice i samples with
        ``choice_seed(seed, i)``, so a seeded request reproduces every choice.
        A prompt-only request generates nothing (max_new_tokens 0): a
        prefill, no drafter."""
        max_new = 0 if request.prompt_only else self._max_new_tokens(request.max_new_tokens)
        sampling = request.sampling.check_vocabulary(self.verifier_info.vocab_size, "sampling")
        if sampling.seed is None:          # drawn here so that the verifier and the logs share it
            sampling = replace(sampling, seed=secrets.randbits(63))
        # explicit knobs for a drafter (the loop clamps them to the one it pins), or None for root-only trees;
        # lookahead decoding needs no drafter (the verifier drafts from the target)
        tree = None if request.prompt_only else request.tree.resolve(self.config.tree)
        if tree is not None and tree.method != LOOKAHEAD and not self.config.drafters.configured:
            tree = None
        prompt_ids = self._prompt_ids(request)
        context = self.verifier_info.max_positions
        if len(prompt_ids) + max_new > context:
            raise InvalidArgument(f"prompt is too long: {len(prompt_ids)} tokens + max_new_tokens {max_new} "
                                  f"exceed the model's context of {context} tokens")
        return [self._generation(prompt_ids, max_new, replace(sampling, seed=choice_seed(sampling.seed, i)),
                                 tree, request, deadline, salt) for i in range(request.n)]

    def _generation(self, prompt_ids: list[int], max_new: int, sampling, tree: TreeParams | None,
                    request: GenerationRequest, deadline: Deadline, salt: str = "") -> Generation:
        text = TextStream(self.tokenizer, list(request.stop))
        stop = StopCriteria(max_new_tokens=max_new, eos_ids=self.tokenizer.eos_ids, stop_check=text.stop_check)
        job = Job(session_id=uuid.uuid4().hex, prompt_ids=prompt_ids, max_new_tokens=max_new, sampling=sampling,
                  tree=tree, logprobs=request.logprobs, prompt_logprobs=request.prompt_logprobs, cache_salt=salt)
        log.info("generation", extra={"session": job.session_id, "prompt_tokens": len(prompt_ids),
                                      "max_new_tokens": max_new, "seed": sampling.seed,
                                      "method": tree.method if tree else VANILLA})
        # --min-tau auto: the pinned drafter kind's default, until the pair's break-even is measured
        decoding = Decoding(stop, self.config.min_tau or 0.0, prior=self.config.min_tau is None)
        return Generation(self.router, job, decoding, text, deadline,
                          self.config.verify_token_budget, self.config.lookahead,
                          gate_by_kind=self.config.min_tau is None, streams=self.config.session_streams,
                          ahead_budget=self.config.lookahead_budget, direct=self.config.plane == DIRECT)

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The prompt's token ids: given, or the text (rendered chat messages) encoded."""
        if request.prompt_ids:
            vocab = self.verifier_info.vocab_size
            bad = next((i for i, t in enumerate(request.prompt_ids) if t >= vocab), None)
            if bad is not None:
                raise InvalidArgument(f"prompt_ids[{bad}] = {request.prompt_ids[bad]} is outside the "
                                      f"vocabulary [0, {vocab})")
            return list(request.prompt_ids)
        if request.messages:
            if self.chat_renderer is None:
                raise InvalidArgument("messages: this server has no chat template to render them with")
            prompt_ids = self.tokenizer.encode(self.chat_renderer(request.messages))
        else:
            prompt_ids = self.tokenizer.encode(request.prompt)
        if not prompt_ids:
            raise InvalidArgument("prompt encodes to no tokens")
        return prompt_ids

    def _max_new_tokens(self, value: int) -> int:
        """A request's max_new_tokens (already >= 0) within this server's limit; 0 takes the default."""
        limit = self.config.max_new_tokens_limit
        if value > limit:
            raise InvalidArgument(f"max_new_tokens must be <= {limit}, got {value}")
        return value or min(self.config.default_max_new_tokens, limit)

    # -- results --------------------------------------------------------------------------
    def _stats(self, gen: Generation, index: int = 0) -> orchestrator_pb2.GenerationStats:
        s = gen.dec.stats
        return orchestrator_pb2.GenerationStats(
            prompt_tokens=len(gen.job.prompt_ids), completion_tokens=len(gen.dec.tokens), cycles=s.cycles,
            tau=s.tau, accepted_per_position=s.accepted_per_position, draft_tokens=s.drafted,
            accepted_tokens=s.accepted, ttft_s=s.ttft_s, wall_s=s.wall_s, ahead_hits=s.ahead_hits,
            ahead_committed=s.ahead_committed,
            finish_reason=gen.dec.finish_reason or "", request_id=request_id_var.get(), index=index,
            wire_bytes=gen.wire_bytes, ahead_draft_s=gen.ahead_draft_s, **gen.timing())

    @staticmethod
    def _count(gen: Generation, status: str) -> None:
        s = gen.dec.stats
        metrics.DRAFTS.inc(gen.drafts)
        metrics.DRAFT_TOKENS.inc(s.drafted)
        metrics.ACCEPTED_TOKENS.inc(s.accepted)
        for position, cycles in enumerate(s.accepted_per_position, 1):
            metrics.ACCEPTED_PER_POSITION.labels(str(position)).inc(cycles)
        log.info("generation done", extra={
            "session": gen.job.session_id, "status": status, "tokens": len(gen.dec.tokens), "cycles": s.cycles,
            "tau": round(s.tau, 3), "finish_reason": gen.dec.finish_reason, "wall_s": round(s.wall_s, 4),
            "verifier": gen.verifier.address if gen.verifier else None,
            "drafter": gen.drafter.address if gen.drafter else None, "moves": gen.moves})


def bearer_token(context) -> str:
    """The bearer token a gRPC caller presented ("" for none): its tenant."""
    for key, value in (context.invocation_metadata() or ()) if context is not None else ():
        if key == "authorization":
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


async def choice_emit(emit: Emit, index: int, gen: Generation, delta: Delta) -> None:
    """Pass choice ``index``'s chunk on with the logprobs of its tokens (the
    last ``len(delta.token_ids)`` the text stream sent)."""
    end = gen.text.sent_tokens
    await emit(index, delta, gen.dec.logprobs[end - len(delta.token_ids):end])


async def run_all(runs: list[Awaitable[None]]) -> None:
    """Await every choice's run; the first failure cancels the others (whose
    ``finally`` releases their sessions) and is raised."""
    if len(runs) == 1:
        await runs[0]
        return
    tasks = [asyncio.ensure_future(r) for r in runs]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _expired(deadline: Deadline) -> bool:
    return deadline.at is not None and time.monotonic() >= deadline.at
