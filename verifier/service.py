"""VerifierService: the gRPC face of ``verifier.engine.VerifierEngine``.

Each RPC converts its message (``specdec.request.wire``, bounds from
``specdec.request.params``), runs one engine call on the servicer's worker thread and
translates the result. Handlers just raise; the server's interceptor turns
errors into statuses (``specdec.serving.server.status_code_of``): a malformed tree is INVALID_ARGUMENT naming
the field, an unknown or evicted session NOT_FOUND, the session cap
RESOURCE_EXHAUSTED, a tree whose root is not the last committed token
FAILED_PRECONDITION, loading or draining UNAVAILABLE. ``Prefill`` with
``resume`` reopens a session moved from a lost verifier (the orchestrator's
failover): its committed tokens are recomputed and nothing is sampled.

``Run`` is the direct plane (``verifier.plane``): a whole request run here,
drafting on the paired drafter over this verifier's own stream to it
(``verifier.paired``), every commit streamed back to the orchestrator.

``Session`` carries one session's steps (Prefill then Verify) on one bidirectional
stream, each handled as its unary RPC; the session is released when the
stream ends (``specdec.serving.engine_servicer.EngineServicer.serve_session``).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Callable

from specdec.request import wire
from specdec.request.errors import InvalidArgument
from specdec.request.pace import Paces
from specdec.request.params import (SamplingParams, check_cache_salt, check_count, check_logprobs, check_owner,
                                    check_session_id, check_token_ids)
from specdec.serving import metrics, tensor_wire
from specdec.serving.engine_servicer import EngineServicer
from specdec.serving.server import ClientTls
from specdec.serving.sessions import DEFAULT_LEASE_S
from specdec.tree.build import tree_from_lists
from specdec.tree.sizing import restore
from specdec.v1 import verifier_pb2, verifier_pb2_grpc
from verifier import plane
from verifier.paired import Peers

log = logging.getLogger("specdec.verifier")

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name


@dataclass(frozen=True)
class VerifierServiceConfig:
    feature_dtype: str = "float32"     # dtype of the features sent to EAGLE drafters
    model_name: str = ""               # reported by GetInfo (default: the target's path)
    batch_window_ms: float = 0.0       # >0: verify concurrent sessions' trees in one forward
    max_batch: int = 16
    solo_threads: int = 0              # >0: torch threads while at most one session is open
    lease_s: float = DEFAULT_LEASE_S   # an orchestrator's session outlives its last lease renewal this long
    peer_tls: ClientTls | None = None  # the direct plane: how this verifier reaches its paired drafters
    peer_token: str | None = None      # their bearer token

    def __post_init__(self):
        if self.feature_dtype not in ("float32", "float16"):
            raise ValueError(f"feature dtype must be float32 or float16, got {self.feature_dtype!r}")


class VerifierService(EngineServicer, verifier_pb2_grpc.VerifierServiceServicer):
    role = "verifier"

    def __init__(self, config: VerifierServiceConfig = VerifierServiceConfig()):
        super().__init__(config.solo_threads, config.lease_s)
        self.config = config
        self.engine = None                 # VerifierEngine, once loaded
        self.scheduler = None              # BatchScheduler when batching is on
        self.peers = Peers(config.peer_tls, config.peer_token)   # drafters paired on the direct plane
        self.paces = Paces()        # what cycles cost per paired drafter (greedy gates, specdec.request.pace)

    def registration(self) -> tuple[Callable, object, str]:
        """The (add_to_server, servicer, service name) triple for ``start_server``."""
        return verifier_pb2_grpc.add_VerifierServiceServicer_to_server, self, SERVICE_NAME

    # -- loading ------------------------------------------------------------------------
    async def load(self, build: Callable[[], object]) -> None:
        """Build the engine on the worker thread (``build()`` -> VerifierEngine),
        warm it up, start the idle sweeper. The server goes ready afterwards."""
        engine, seconds = await self.run(build)
        _, warm_s = await self.run(self._warm_up, engine)
        self.engine, self.sessions = engine, engine.sessions
        if self.config.batch_window_ms > 0:
            from verifier.batch import BatchScheduler

            self.scheduler = BatchScheduler(lambda items: self.run(self.engine.verify_batch, items),
                                            lambda: len(self.sessions), self.config.batch_window_ms / 1000,
                                            self.config.max_batch)
            batches = getattr(engine.target, "compile_batches", None)
            if batches is not None:
                await self.run(batches)      # batched compiled forwards, built before readiness
        self._refresh_stats()
        self.start_sweeper(getattr(engine, "ttl_s", None))
        compiled = getattr(engine.target, "compiled", None)
        if compiled is not None and compiled.due:
            # compiled graphs left for later open while no request is in flight (``CompiledForward.open_next``)
            self.start_when_idle(compiled.open_next)
        log.info("verifier loaded", extra={"load_s": round(seconds, 3), "warm_up_s": round(warm_s, 3),
                                           "vocab_size": engine.target.vocab_size})

    @staticmethod
    def _warm_up(engine) -> None:
        """One small prefill and tree verify on a throwaway session."""
        sid = f"warm-up-{uuid.uuid4().hex}"
        vocab = engine.target.vocab_size
        prompt = [i % vocab for i in range(1, 5)]
        try:
            first = engine.prefill(sid, prompt, SamplingParams())
            engine.verify(sid, tree_from_lists([first.token, prompt[0], prompt[1]], [-1, 0, 1]))
        finally:
            engine.release(sid)

    async def aclose(self) -> None:
        if self.scheduler is not None:          # its batching task ends with the server, not after the loop
            await self.scheduler.close()
        await self.peers.close()
        await super().aclose()

    def _evict(self) -> list[str]:
        # an engine replicated over tensor-parallel ranks evicts on every rank
        evict = getattr(self.engine, "evict_idle", None)
        return evict() if evict is not None else self.sessions.evict_idle()

    def _kv_bytes(self) -> int:
        return self.engine.kv_bytes() if self.engine is not None else 0

    def _prefix_cache(self):
        return self.engine.prefix.blocks if self.engine is not None else None

    def _features(self, features):
        return tensor_wire.tensor_to_proto(features, self.config.feature_dtype)

    # -- RPCs (errors become statuses in specdec.serving.server's interceptor) -------------------------
    async def Prefill(self, request, context):
        self.check(opens_session=True)
        sid = check_session_id(request.session_id)
        vocab = self.engine.target.vocab_size
        params = wire.sampling_from_proto(request.sampling).check_vocabulary(vocab, "sampling")
        max_new = check_count(request.max_new_tokens, "max_new_tokens", note="0 = no reservation")
        owner = check_owner(request.owner)
        prompt = check_token_ids(request.prompt_ids, vocab, "prompt_ids", min_count=1)
        if request.resume and len(prompt) < 2:    # the last token is the pending root: a prompt comes before it
            raise InvalidArgument(f"prompt_ids: resuming a session needs at least two committed tokens, "
                                  f"got {len(prompt)}")
        logprobs = check_logprobs(request.logprobs if request.HasField("logprobs") else None)
        prompt_logprobs = check_logprobs(request.prompt_logprobs if request.HasField("prompt_logprobs") else None,
                                         "prompt_logprobs")
        prompt_tokens = check_count(request.prompt_tokens, "prompt_tokens", note="0 = all")
        salt = check_cache_salt(request.cache_salt)
        result, seconds = await self.open_session(context, sid, owner, self.engine.prefill, sid, prompt, params,
                                                  max_new, request.resume, logprobs, prompt_tokens,
                                                  tuple(request.feature_layers), prompt_logprobs, salt)
        metrics.PREFILL_DURATION.labels(self.role).observe(seconds)
        response = verifier_pb2.VerifierPrefillResponse(
            token=result.token, compute_s=seconds, logprobs=wire.logprobs_to_proto(result.logprobs or ()),
            prompt_logprobs=wire.logprobs_to_proto(result.prompt_logprobs or ()))
        if request.return_features:
            response.features.CopyFrom(self._features(result.features))
        return response

    async def Verify(self, request, context):
        self.check()
        sid = check_session_id(request.session_id)
        if request.lookahead_depth:
            return await self.verify_lookahead(sid, check_count(request.lookahead_depth, "lookahead_depth"),
                                               request.return_features)
        tree = tensor_wire.tree_from_proto(request.tree, self.engine.target.vocab_size)
        # cut here, before a tensor-parallel engine broadcasts the tree to its ranks (``specdec.tree.sizing``)
        sizer, keep = getattr(self.engine, "sizer", None), None
        if sizer is not None:
            tree, keep = sizer.cut(sid, tree, self.sessions.get(sid).params.greedy)
        # a lone session's batch would close at once: skip the scheduler's extra task hop
        if self.scheduler is not None and len(self.sessions) > 1:
            result, seconds = await self.scheduler.verify(sid, tree)
        else:
            result, seconds = await self.run(self.engine.verify, sid, tree)
        if sizer is not None:
            sizer.verified(sid, tree.size, seconds, len(result.tokens))
        return self.verify_response(result, seconds, restore(result.accepted, keep), tree.size,
                                    request.return_features)

    async def verify_lookahead(self, sid: str, depth: int, features: bool):
        """A lookahead decoding step (``VerifierEngine.verify_lookahead``). It
        runs on its own, never in a batch (its forward holds the window beside
        the tree), and is not cut to the verifier's cost (its tree is the pool's)."""
        result, seconds = await self.run(self.engine.verify_lookahead, sid, depth)
        return self.verify_response(result, seconds, result.accepted, result.nodes, features)

    def verify_response(self, result, seconds: float, accepted: list[int], nodes: int, features: bool):
        metrics.VERIFY_DURATION.observe(seconds)
        response = verifier_pb2.VerifyResponse(accepted_nodes=accepted, tokens=result.tokens, compute_s=seconds,
                                               verified_nodes=nodes,
                                               logprobs=wire.logprobs_to_proto(result.logprobs or ()))
        if features:
            response.features.CopyFrom(self._features(result.features))
        return response

    async def Session(self, request_iterator, context):
        steps = {"prefill": self.Prefill, "verify": self.Verify}
        async for response in self.serve_session(request_iterator, context, steps,
                                                 verifier_pb2.VerifierSessionResponse):
            yield response

    async def Run(self, request_iterator, context):
        async for event in plane.run(self, request_iterator, context):
            yield event

    async def Rollback(self, request, context):
        self.check()
        await self.run(self.engine.rollback, check_session_id(request.session_id), request.length)
        return verifier_pb2.VerifierRollbackResponse()

    async def Release(self, request, context):
        self.check()
        # shielded: a client that gives up on Release still gets the memory freed
        released, _ = await self.run(self.engine.release, check_session_id(request.session_id), shield=True)
        return verifier_pb2.VerifierReleaseResponse(released=released)

    async def Renew(self, request, context):
        renewed = self.renew(request.owner, request.session_ids)
        return verifier_pb2.VerifierRenewResponse(renewed=renewed, lease_s=self.lease_s)

    def release_session(self, sid: str) -> bool:
        return self.engine.release(sid)

    async def GetInfo(self, request, context):
        self.check()
        target = self.engine.target
        return verifier_pb2.VerifierGetInfoResponse(
            model=self.config.model_name or str(target.spec.path), vocab_size=target.vocab_size,
            hidden_size=int(target.config.hidden_size), max_positions=target.max_positions,
            active_sessions=self.stats.active, max_sessions=self.sessions.max_sessions,
            kv_bytes=self.stats.kv_bytes, num_layers=target.num_layers)
