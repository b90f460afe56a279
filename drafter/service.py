"""DrafterService: the gRPC face of one ``drafter.base.Drafter`` (EAGLE head,
small LM or n-gram).

``Draft`` is the per-cycle call: commit the tokens the verifier accepted last
cycle (with their target features for EAGLE), then build a tree with the
request's knobs, 0 meaning the server default and every knob clamped to the
server's limits (``specdec.request.params.TreeRequest.resolve``). Handlers just
raise; status mapping as in ``verifier.service``. With
``batch_window_ms`` > 0, concurrent sessions' Draft calls are collected by a
``drafter.batch.DraftScheduler`` and drafted together, one model forward per
tree level for all of them (``drafter.batch.draft_batch``); each still gets
the tree it would get alone.

``DraftAhead`` (drafting one round ahead, ``Drafter.draft_ahead``) runs while
the verifier checks the session's tree: it commits the last cycle's tokens and
drafts the trees the next cycle would use for the likeliest outcomes, so that
on a hit the orchestrator skips the next Draft round trip. It uses a drafter
that would otherwise sit idle, so with other sessions open it only commits.

``Session`` carries one session's steps (Prefill then Draft / DraftAhead) on one bidirectional
stream, each handled as its unary RPC; the session is released when the
stream ends (``specdec.serving.engine_servicer.EngineServicer.serve_session``).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Callable

import torch

from specdec.model import kv
from specdec.request import wire
from specdec.request.errors import InvalidArgument
from specdec.request.params import (LOOKAHEAD, TreeParams, check_cache_salt, check_count, check_owner, check_session_id,
                                    check_token_ids)
from specdec.serving import metrics, tensor_wire
from specdec.serving.engine_servicer import EngineServicer
from specdec.serving.sessions import DEFAULT_LEASE_S
from specdec.tree.build import tree_from_lists
from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

log = logging.getLogger("specdec.drafter")

MAX_AHEAD_PATHS = 8                    # accepted paths one DraftAhead may draft for
SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name


@dataclass(frozen=True)
class DrafterServiceConfig:
    default_tree: TreeParams = TreeParams()                          # knobs a request leaves at 0
    limits: TreeParams = TreeParams(total_tokens=64, depth=8, expand_k=10)   # clamps; method unused
    batch_window_ms: float = 0.0       # >0: draft concurrent sessions' trees in shared forwards
    max_batch: int = 16
    solo_threads: int = 0              # >0: torch threads while at most one session is open
    lease_s: float = DEFAULT_LEASE_S   # an orchestrator's session outlives its last lease renewal this long

    def __post_init__(self):
        if not self.batch_window_ms >= 0 or isinstance(self.max_batch, bool) or not self.max_batch >= 1:
            raise ValueError(f"batch_window_ms must be >= 0 and max_batch >= 1, got {self.batch_window_ms} "
                             f"and {self.max_batch}")
        # the default itself obeys the limits
        object.__setattr__(self, "default_tree", self.default_tree.clamped(self.limits))


class DrafterService(EngineServicer, drafter_pb2_grpc.DrafterServiceServicer):
    role = "drafter"

    def __init__(self, config: DrafterServiceConfig = DrafterServiceConfig()):
        super().__init__(config.solo_threads, config.lease_s)
        self.config = config
        self.drafter = None                # drafter.base.Drafter, once loaded
        self.scheduler = None              # drafter.batch.DraftScheduler when batching is on

    def registration(self) -> tuple[Callable, object, str]:
        """The (add_to_server, servicer, service name) triple for ``start_server``."""
        return drafter_pb2_grpc.add_DrafterServiceServicer_to_server, self, SERVICE_NAME

    # -- loading --------------------------------------------------------------------------
    async def load(self, build: Callable[[], object]) -> None:
        """Build the drafter on the worker thread, warm it up, start the sweeper."""
        drafter, seconds = await self.run(build)
        _, warm_s = await self.run(self._warm_up, drafter)
        self.drafter, self.sessions = drafter, drafter.sessions
        if self.config.batch_window_ms > 0:
            from drafter.batch import DraftScheduler, draft_batch

            self.scheduler = DraftScheduler(lambda items: self.run(draft_batch, self.drafter, items),
                                            lambda: len(self.sessions), self.config.batch_window_ms / 1000,
                                            self.config.max_batch)
        self._refresh_stats()
        self.start_sweeper()
        log.info("drafter loaded", extra={"kind": drafter.name, "load_s": round(seconds, 3),
                                          "warm_up_s": round(warm_s, 3), "vocab_size": drafter.vocab_size})

    def _warm_up(self, drafter) -> None:
        """Prefill, draft, commit, draft on a throwaway session."""
        sid = f"warm-up-{uuid.uuid4().hex}"
        tokens = [i % drafter.vocab_size for i in range(1, 6)]
        width = getattr(drafter, "feature_size", None)
        feats = (lambda n: torch.zeros(n, width)) if drafter.needs_features else (lambda n: None)
        try:
            drafter.prefill(sid, tokens, feats(len(tokens) - 1))
            drafter.draft(sid, self.config.default_tree)
            drafter.commit(sid, tokens[:1], feats(1))
            drafter.draft(sid, self.config.default_tree)
        finally:
            drafter.release(sid)

    def _kv_bytes(self) -> int:
        return sum(kv.nbytes(s.cache) for _, s in self.drafter.sessions.items() if s.cache is not None)

    def _prefix_cache(self):
        return self.drafter.prefix if self.drafter is not None else None

    def _feature_tensor(self, msg, field: str, rows: int) -> torch.Tensor | None:
        feats = tensor_wire.tensor_from_proto(msg, field)
        if not self.drafter.needs_features:
            return None
        width = getattr(self.drafter, "feature_size", None)      # the verifier's feature row
        if feats is None or feats.ndim != 2 or feats.shape[0] != rows or (width and feats.shape[1] != width):
            got = None if feats is None else list(feats.shape)
            raise InvalidArgument(f"{field}.shape must be [{rows}, {width or 'hidden'}] for the "
                                  f"{self.drafter.name} drafter, got {got}")
        return feats

    def _commit_of(self, request) -> tuple[list[int], torch.Tensor | None]:
        """A Draft / DraftAhead request's commit: (tokens, their features or None)."""
        tokens = check_token_ids(request.commit_tokens, self.drafter.vocab_size, "commit_tokens",
                                 vocabulary="drafter vocabulary")
        if not tokens:
            if request.commit_features.data or request.commit_features.shape:
                raise InvalidArgument("commit_features given without commit_tokens")
            return tokens, None
        return tokens, self._feature_tensor(request.commit_features, "commit_features", len(tokens))

    def _tree_config(self, msg) -> TreeParams | None:
        cfg = wire.tree_config_from_proto(msg, self.config.default_tree, self.config.limits)
        if cfg is not None and cfg.method == LOOKAHEAD:
            raise InvalidArgument("tree.method lookahead is drafted by the verifier (VerifyRequest.lookahead_depth), "
                                  "not by a drafter")
        return cfg

    def _commit_and_draft(self, sid: str, tokens: list[int], feats, cfg: TreeParams | None, ahead: bool = False):
        if tokens:
            self.drafter.commit(sid, tokens, feats)
        if cfg is None:                   # VANILLA: no drafting, the tree is the root alone
            return tree_from_lists([self.drafter.sessions.get(sid).tokens[-1]], [-1])
        return self.drafter.draft(sid, cfg, ahead=True) if ahead else self.drafter.draft(sid, cfg)

    def _draft_ahead(self, sid: str, tokens: list[int], feats, cfg: TreeParams, count: int, tokens_left: int,
                     budget_s: float):
        # another session's work comes first: drafting ahead uses a drafter that would sit idle
        if len(self.sessions) > 1:
            count = 0
        return self.drafter.draft_ahead(sid, tokens, feats, cfg, count, tokens_left, budget_s)

    async def aclose(self) -> None:
        if self.scheduler is not None:
            await self.scheduler.close()
        await super().aclose()

    # -- RPCs (errors become statuses in specdec.serving.server's interceptor) -------------------------------
    async def Prefill(self, request, context):
        self.check(opens_session=True)
        sid = check_session_id(request.session_id)
        # an EAGLE drafter's first input pairs a prompt token's feature with the token after it
        tokens = check_token_ids(request.token_ids, self.drafter.vocab_size, "token_ids",
                                 min_count=2 if self.drafter.needs_features else 1, vocabulary="drafter vocabulary")
        feats = self._feature_tensor(request.features, "features", len(tokens) - 1)
        sampling = wire.sampling_from_proto(request.sampling) if request.HasField("sampling") else None
        owner = check_owner(request.owner)
        salt = check_cache_salt(request.cache_salt)
        _, seconds = await self.open_session(context, sid, owner, self.drafter.prefill, sid, tokens, feats,
                                             request.greedy, sampling, salt)
        metrics.PREFILL_DURATION.labels(self.role).observe(seconds)
        return drafter_pb2.DrafterPrefillResponse()

    async def Draft(self, request, context):
        self.check()
        sid = check_session_id(request.session_id)
        tokens, feats = self._commit_of(request)
        cfg = self._tree_config(request.tree)
        # with one session open there is nothing to batch (and a tree to draft ahead from is drafted alone):
        # a lone session's batch would close at once, so it skips the scheduler's extra task hop
        if self.scheduler is not None and len(self.sessions) > 1:
            tree, seconds = await self.scheduler.draft(sid, tokens, feats, cfg)
        else:
            tree, seconds = await self.run(self._commit_and_draft, sid, tokens, feats, cfg, request.ahead)
        metrics.DRAFT_DURATION.observe(seconds)
        return drafter_pb2.DraftResponse(tree=tensor_wire.tree_to_proto(tree), compute_s=seconds)

    async def DraftAhead(self, request, context):
        self.check()
        sid = check_session_id(request.session_id)
        count = min(check_count(request.count, "count", note="0 = commit only"), MAX_AHEAD_PATHS)
        tokens_left = check_count(request.tokens_left, "tokens_left")
        tokens, feats = self._commit_of(request)
        cfg = self._tree_config(request.tree)
        if cfg is None:
            raise InvalidArgument("tree: DraftAhead needs tree knobs (method VANILLA drafts nothing)")
        if not request.budget_s >= 0:
            raise InvalidArgument(f"budget_s must be >= 0 (0 = no limit), got {request.budget_s}")
        trees, seconds = await self.run(self._draft_ahead, sid, tokens, feats, cfg, count, tokens_left,
                                        request.budget_s)
        metrics.DRAFT_AHEAD_DURATION.observe(seconds)
        return drafter_pb2.DraftAheadResponse(
            trees=[drafter_pb2.AheadTree(commit_tokens=commit, tree=tensor_wire.tree_to_proto(tree)) for commit, tree in trees],
            compute_s=seconds, paths=len({tuple(commit[:-1]) for commit, _ in trees}))

    async def Session(self, request_iterator, context):
        steps = {"prefill": self.Prefill, "draft": self.Draft, "draft_ahead": self.DraftAhead}
        async for response in self.serve_session(request_iterator, context, steps,
                                                 drafter_pb2.DrafterSessionResponse):
            yield response

    async def Commit(self, request, context):
        self.check()
        sid = check_session_id(request.session_id)
        tokens = check_token_ids(request.token_ids, self.drafter.vocab_size, "token_ids",
                                 vocabulary="drafter vocabulary")
        feats = self._feature_tensor(request.features, "features", len(tokens))
        await self.run(self.drafter.commit, sid, tokens, feats)
        return drafter_pb2.DrafterCommitResponse()

    async def Rollback(self, request, context):
        self.check()
        await self.run(self.drafter.rollback, check_session_id(request.session_id), request.length)
        return drafter_pb2.DrafterRollbackResponse()

    async def Release(self, request, context):
        self.check()
        released, _ = await self.run(self.drafter.release, check_session_id(request.session_id), shield=True)
        return drafter_pb2.DrafterReleaseResponse(released=released)

    async def Renew(self, request, context):
        renewed = self.renew(request.owner, request.session_ids)
        return drafter_pb2.DrafterRenewResponse(renewed=renewed, lease_s=self.lease_s)

    def release_session(self, sid: str) -> bool:
        return self.drafter.release(sid)

    async def GetInfo(self, request, context):
        self.check()
        limits = self.config.limits
        return drafter_pb2.DrafterGetInfoResponse(
            kind=self.drafter.name, needs_features=self.drafter.needs_features, vocab_size=self.drafter.vocab_size,
            drafts_ahead=self.drafter.drafts_ahead, feature_layers=getattr(self.drafter, "feature_layers", ()),
            active_sessions=self.stats.active, max_sessions=self.sessions.max_sessions,
            max_tree=common_pb2.TreeParams(total_tokens=limits.total_tokens, depth=limits.depth,
                                           expand_k=limits.expand_k))
