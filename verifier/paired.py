"""The paired drafter of the direct plane: ``specdec.request.speculative``'s
``Drafter`` over one drafter's Session stream, opened by this verifier.

The orchestrator pairs a session's verifier with a drafter (``RunStart.drafter``);
the verifier reaches it with its peer credentials (``Peers``: one channel per
drafter address, so every session paired with that drafter shares one
HTTP/2 connection, each session a stream on it). The session's per-cycle
steps (Prefill, Draft, DraftAhead) travel on that stream and nowhere else:
the verifier sends the commits it made, with their feature rows, and gets
the next tree back.

A drafter that fails (any status, the stream ending unanswered) or sends
feature rows that do not line up leaves the session drafterless: ``draft``
answers None and the loop goes on as plain decoding (root-only cycles:
the output is the same), with the reason kept in ``fallback`` for the run's
summary. The drafter's session is released when the stream ends: half-closed
by ``release``, cancelled when the run is, broken when this verifier dies.

May import: ``specdec.request``, ``specdec.serving`` and ``specdec.v1``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

import grpc

from specdec.request import wire
from specdec.request.params import SamplingParams, TreeParams
from specdec.request.speculative import Committed, Draft
from specdec.request.wire import FeatureLog, clamp_tree
from specdec.serving.server import ClientTls, open_channel
from specdec.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger("specdec.verifier")

RELEASE_TIMEOUT_S = 5.0
INFO_TIMEOUT_S = 5.0


class PeerFailed(Exception):
    """A step on the paired drafter's stream failed."""


@dataclass
class Peer:
    """One drafter this verifier talks to: its channel and what it said of itself."""

    address: str
    channel: grpc.aio.Channel
    stub: drafter_pb2_grpc.DrafterServiceStub
    info: drafter_pb2.DrafterGetInfoResponse


class Peers:
    """The drafters this verifier is paired with, one channel each, kept while it runs."""

    def __init__(self, tls: ClientTls | None = None, token: str | None = None):
        self.tls, self.token = tls, token
        self.peers: dict[str, Peer] = {}

    async def get(self, address: str) -> Peer:
        """The peer at ``address``, asked for its info the first time (it may have
        restarted since: a failed step drops it, and the next session asks again)."""
        peer = self.peers.get(address)
        if peer is not None:
            return peer
        channel = open_channel(address, self.tls, self.token)
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        try:
            info = await stub.GetInfo(drafter_pb2.DrafterGetInfoRequest(), timeout=INFO_TIMEOUT_S)
        except BaseException:
            await channel.close()
            raise
        peer = self.peers.setdefault(address, Peer(address, channel, stub, info))
        if peer.channel is not channel:        # another session opened it meanwhile
            await channel.close()
        return peer

    def forget(self, peer: Peer) -> None:
        """Ask ``peer`` for its info again next time (its channel stays: sessions may still use it)."""
        if self.peers.get(peer.address) is peer:
            del self.peers[peer.address]

    async def close(self) -> None:
        peers, self.peers = list(self.peers.values()), {}
        await asyncio.gather(*(p.channel.close() for p in peers), return_exceptions=True)


class PairedDrafter:
    """One session on the paired drafter (``speculative.Drafter``)."""

    def __init__(self, peers: Peers, peer: Peer, session_id: str, owner: str, cache_salt: str,
                 deadline_s: float | None):
        self.peers, self.peer = peers, peer
        self.session_id = session_id
        self.owner, self.cache_salt = owner, cache_salt
        self.deadline_s = deadline_s              # the run's (its stream ends with it)
        self.stream: grpc.aio.StreamStreamCall | None = None
        self.alive = True                         # False once it failed: plain decoding from then on
        self.fallback = ""                        # why it failed
        self.wants_features = peer.info.needs_features
        self.network_s = 0.0                      # step wall time the drafter did not report as compute
        self.drafts = 0                           # trees drafted (Draft steps answered)
        self.ahead_s = 0.0                        # drafter compute of the DraftAhead steps
        self.wire_bytes = 0
        # seconds a DraftAhead may take (the verify it hides behind); None: no limit
        self.ahead_budget: Callable[[], float] | None = None
        self.lost: Callable[[str], None] | None = None     # told why, when the drafter fails

    @property
    def needs_features(self) -> bool:
        return self.alive and self.wants_features

    @property
    def drafts_ahead(self) -> bool:
        return self.alive and self.peer.info.drafts_ahead

    @property
    def feature_layers(self) -> list[int]:
        return list(self.peer.info.feature_layers)

    async def prefill(self, tokens: list[int], features, sampling: SamplingParams) -> None:
        request = drafter_pb2.DrafterPrefillRequest(
            session_id=self.session_id, token_ids=tokens, features=features if self.wants_features else None,
            greedy=sampling.greedy, sampling=wire.sampling_to_proto(sampling), owner=self.owner,
            cache_salt=self.cache_salt)
        try:
            self.stream = self.peer.stub.Session(timeout=self.deadline_s)
            await self.step("prefill", request)
        except PeerFailed as exc:
            self.fail(str(exc))

    async def draft(self, commits: list[Committed], tree: TreeParams, ahead: bool) -> Draft | None:
        """This cycle's tree (carrying ``commits``), or None: the drafter is gone."""
        tokens, features = self.take(commits)
        if not self.alive:
            return None
        request = drafter_pb2.DraftRequest(session_id=self.session_id, commit_tokens=tokens, tree=self.fit(tree),
                                           commit_features=features.tensor() if tokens else None,
                                           ahead=ahead and self.drafts_ahead)
        try:
            response = await self.step("draft", request)
        except PeerFailed as exc:
            self.fail(str(exc))
            return None
        self.drafts += 1
        return Draft(response.tree, len(response.tree.tokens))

    async def draft_ahead(self, commits: list[Committed], tree: TreeParams, count: int,
                          tokens_left: int) -> dict[tuple[int, ...], Draft]:
        tokens, features = self.take(commits)
        if not self.alive:
            return {}
        request = drafter_pb2.DraftAheadRequest(
            session_id=self.session_id, commit_tokens=tokens, tree=self.fit(tree), count=count,
            tokens_left=tokens_left, commit_features=features.tensor() if tokens else None,
            budget_s=self.ahead_budget() if self.ahead_budget is not None else 0.0)
        try:
            response = await self.step("draft_ahead", request, account=False)
        except PeerFailed as exc:
            self.fail(str(exc))
            return {}
        self.ahead_s += response.compute_s
        return {tuple(t.commit_tokens): Draft(t.tree, len(t.tree.tokens)) for t in response.trees}

    async def release(self) -> None:
        """Half-close the stream and wait for its end (the drafter releases the
        session as it ends); cancel it when that does not come in time."""
        stream, self.stream = self.stream, None
        if stream is None or stream.done():
            return
        try:
            await asyncio.wait_for(stream.done_writing(), RELEASE_TIMEOUT_S)
            await asyncio.wait_for(stream.code(), RELEASE_TIMEOUT_S)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError):
            pass
        finally:
            if not stream.done():
                stream.cancel()

    # -- the stream ------------------------------------------------------------------------------
    async def step(self, field: str, request, account: bool = True):
        """One step on the session stream -> its answer; PeerFailed when it fails."""
        stream = self.stream
        if stream is None:
            raise PeerFailed("the drafter's session stream is closed")
        start = time.perf_counter()
        try:
            await stream.write(drafter_pb2.DrafterSessionRequest(**{field: request}))
            answer = await stream.read()
        except asyncio.InvalidStateError:
            raise PeerFailed(f"{field}: the drafter's session stream had ended ({await stream.code()})") from None
        except grpc.aio.AioRpcError as exc:
            raise PeerFailed(f"{field}: {exc.code().name} {exc.details()}") from None
        if answer == grpc.aio.EOF or answer.WhichOneof("step") != field:
            code = await stream.code() if answer == grpc.aio.EOF else None
            raise PeerFailed(f"{field}: the drafter's session stream ended unanswered ({code})")
        response = getattr(answer, field)
        if account:
            wall = time.perf_counter() - start
            self.network_s += wall - min(getattr(response, "compute_s", wall), wall)
        self.wire_bytes += request.ByteSize() + response.ByteSize()
        return response

    def fail(self, reason: str) -> None:
        """Go on without the drafter (plain decoding); the stream is cancelled (the drafter releases)."""
        if not self.alive:
            return
        self.alive, self.fallback = False, reason
        stream, self.stream = self.stream, None
        if stream is not None and not stream.done():
            stream.cancel()
        self.peers.forget(self.peer)
        log.warning("paired drafter failed, going on with plain decoding",
                    extra={"session": self.session_id, "drafter": self.peer.address, "error": reason})
        if self.lost is not None:
            self.lost(reason)

    # -- what the drafter was told ---------------------------------------------------------------
    def fit(self, tree: TreeParams):
        return clamp_tree(wire.tree_params_to_proto(tree), self.peer.info.max_tree)

    def take(self, commits: list[Committed]) -> tuple[list[int], FeatureLog]:
        """``commits``' tokens and feature rows joined, to send with the next step."""
        tokens = [t for c in commits for t in c.tokens]
        joined = FeatureLog()
        if self.alive and self.wants_features:
            try:
                for commit in commits:
                    joined.add(commit.features)
            except ValueError as exc:
                self.fail(f"features: {exc}")
        return tokens, joined
