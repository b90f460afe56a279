"""Session leases and Prefill backstops on the backends (issue 18).

A session opened with an owner lives while its owner renews the lease; one
whose lease lapsed is evicted (seconds, not the idle TTL); a session opened
without an owner keeps the idle TTL. A Prefill whose RPC ends while the
engine opens the session leaves nothing behind once the engine call lands.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from serving.helpers import channel_to, evicted, eventually, rpc_error, start_drafter, start_verifier
from specdec.serving.sessions import SessionTable
from specdec.v1.drafter_pb2 import DrafterGetInfoRequest, DrafterPrefillRequest, DrafterRenewRequest
from specdec.v1.drafter_pb2_grpc import DrafterServiceStub
from specdec.v1.verifier_pb2 import VerifierGetInfoRequest, VerifierPrefillRequest, VerifierRenewRequest
from specdec.v1.verifier_pb2_grpc import VerifierServiceStub

CODE = grpc.StatusCode
PROMPT = [5, 17, 42, 8, 99, 23]
LEASE_S = 0.4


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- the table ------------------------------------------------------------------------------------
def test_a_lapsed_lease_is_evicted_and_an_unowned_session_keeps_the_ttl():
    clock = Clock()
    table = SessionTable(max_sessions=8, ttl_s=100.0, clock=clock, lease_s=2.0)
    for sid in ("renewed", "used", "lapsed", "other-owner", "unowned"):
        table.add(sid, sid)
    for sid in ("renewed", "used", "lapsed", "other-owner"):
        table.lease(sid, "me" if sid != "other-owner" else "them")
    for _ in range(3):                                  # 4.5 s: past the 2 s lease, far short of the TTL
        clock.now += 1.5
        assert table.renew("me", ["renewed", "other-owner", "never-opened"]) == 1
        table.get("used")                               # a call on the session renews it too
    assert sorted(table.evict_idle()) == ["lapsed", "other-owner"]
    assert "renewed" in table and "used" in table and "unowned" in table
    clock.now += 50.0                                   # the owner is gone: leases lapse, the TTL has not
    assert sorted(table.evict_idle()) == ["renewed", "used"]
    clock.now += 50.0
    assert table.evict_idle() == ["unowned"]


async def renew_kept_until_dropped_is_evicted(renew, servicer) -> list:
    """Renew "kept" (``await renew()``) every quarter lease for at least four
    leases, then until "dropped" is evicted (30 s at most): the answers."""
    answers, start = [], time.monotonic()
    while time.monotonic() < start + 4 * LEASE_S or ("dropped" in servicer.sessions
                                                     and time.monotonic() < start + 30):
        answers.append(await renew())
        await asyncio.sleep(LEASE_S / 4)
    return answers


# -- the servers -------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_verifier_evicts_sessions_whose_lease_lapsed(tiny_family):
    server, servicer = await start_verifier(tiny_family, lease_s=LEASE_S, metrics_port=None)
    try:
        async with channel_to(server) as ch:
            stub = VerifierServiceStub(ch)
            for sid, owner in (("kept", "orch-1"), ("dropped", "orch-1"), ("tool", "")):
                await stub.Prefill(VerifierPrefillRequest(session_id=sid, prompt_ids=PROMPT, owner=owner))
            for answer in await renew_kept_until_dropped_is_evicted(
                    lambda: stub.Renew(VerifierRenewRequest(owner="orch-1", session_ids=["kept"])), servicer):
                assert answer.renewed == 1 and answer.lease_s == pytest.approx(LEASE_S)
            assert "kept" in servicer.sessions and "tool" in servicer.sessions
            assert "dropped" not in servicer.sessions
            assert (await stub.GetInfo(VerifierGetInfoRequest())).active_sessions == 2
            for request, field in ((VerifierRenewRequest(session_ids=["kept"]), "owner"),
                                   (VerifierRenewRequest(owner="o", session_ids=["x" * 200]), "session_ids[0]"),
                                   (VerifierPrefillRequest(session_id="s", prompt_ids=PROMPT, owner="o" * 200),
                                    "owner")):
                call = stub.Renew(request) if isinstance(request, VerifierRenewRequest) else stub.Prefill(request)
                err = await rpc_error(call)
                assert err.code() == CODE.INVALID_ARGUMENT and field in err.details(), err.details()
                assert len(err.details()) < 300
    finally:
        await server.stop()


@pytest.mark.asyncio
async def test_drafter_evicts_sessions_whose_lease_lapsed(tiny_family):
    server, servicer = await start_drafter(tiny_family, "ngram", lease_s=LEASE_S, metrics_port=None)
    try:
        async with channel_to(server) as ch:
            stub = DrafterServiceStub(ch)
            for sid, owner in (("kept", "orch-1"), ("dropped", "orch-1"), ("tool", "")):
                await stub.Prefill(DrafterPrefillRequest(session_id=sid, token_ids=PROMPT, owner=owner))
            for answer in await renew_kept_until_dropped_is_evicted(
                    lambda: stub.Renew(DrafterRenewRequest(owner="orch-1", session_ids=["kept"])), servicer):
                assert answer.renewed == 1
            assert (await stub.GetInfo(DrafterGetInfoRequest())).active_sessions == 2
            assert "dropped" not in servicer.sessions
    finally:
        await server.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("owner", ["", "orch-1"])
async def test_a_prefill_whose_rpc_ended_is_released_when_it_lands(tiny_family, monkeypatch, owner):
    """Each engine call is held until its RPC has ended (past its deadline, or
    cancelled), lands having opened the session, and the session is released:
    not left open, and not evicted (an owned session's lease would lapse)."""
    server, servicer = await start_verifier(tiny_family, metrics_port=None)
    original = servicer.engine.prefill
    started, go = threading.Event(), threading.Event()
    landed = []                                     # (session id, open once the engine call returned)

    def held(sid, *args, **kwargs):                 # on the worker thread
        started.set()
        go.wait(30)
        result = original(sid, *args, **kwargs)
        landed.append((sid, sid in servicer.sessions))
        return result

    monkeypatch.setattr(servicer.engine, "prefill", held)
    opening = servicer.open_session
    handler_cancelled = asyncio.Event()             # the server saw the RPC end while the engine call ran

    async def watched(*args, **kwargs):
        try:
            return await opening(*args, **kwargs)
        except asyncio.CancelledError:
            handler_cancelled.set()
            raise

    monkeypatch.setattr(servicer, "open_session", watched)
    try:
        async with channel_to(server) as ch:
            stub = VerifierServiceStub(ch)
            for sid, timeout in (("deadline", 2.0), ("cancelled", None)):
                started.clear()
                go.clear()
                handler_cancelled.clear()
                call = stub.Prefill(VerifierPrefillRequest(session_id=sid, prompt_ids=PROMPT, owner=owner),
                                    timeout=timeout)
                assert await asyncio.to_thread(started.wait, 30)    # the engine call is running
                if timeout is None:
                    call.cancel()
                with pytest.raises((grpc.aio.AioRpcError, asyncio.CancelledError)):
                    await call
                # the client's cancel (or its own deadline) ends the call there at once; the server learns
                # of it a moment later. One that reaches it only after the answer went out cannot be told
                # from a success (an owned session then lapses with its lease): hold the engine call until
                # it arrives.
                await asyncio.wait_for(handler_cancelled.wait(), 30)
                go.set()
                assert await eventually(lambda: sid in dict(landed))
                assert dict(landed)[sid], f"the engine call did not open session {sid}"
                assert await eventually(lambda: sid not in servicer.sessions), f"session {sid} was left open"
            assert [s for s, _ in landed] == ["deadline", "cancelled"] and len(servicer.sessions) == 0
            assert evicted(servicer) == set()           # released, not swept after its lease lapsed
            info = VerifierGetInfoRequest()
            assert await eventually_async(lambda: stub.GetInfo(info), lambda a: a.active_sessions == 0)
    finally:
        go.set()
        await server.stop()


async def eventually_async(call, holds, timeout: float = 30.0) -> bool:
    """Poll ``await call()`` until ``holds(answer)`` (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while not holds(await call()):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


class EndingContext:
    """A servicer context whose RPC is cancelled only after the handler has
    returned (the cancel reached the server too late for the handler to see)."""

    def __init__(self):
        self.ended, self.callbacks = False, []

    def cancelled(self) -> bool:
        return self.ended

    def time_remaining(self):
        return None

    def add_done_callback(self, callback) -> None:
        self.callbacks.append(callback)

    def end(self, cancelled: bool) -> None:
        self.ended = cancelled
        for callback in self.callbacks:
            callback(self)


@pytest.mark.asyncio
async def test_a_prefill_cancelled_after_its_handler_returned_is_released(tiny_family):
    """The handler returned the answer, then the RPC ended cancelled (the client
    never got it): the session is released; one whose RPC ends well stays."""
    server, servicer = await start_verifier(tiny_family, metrics_port=None)
    try:
        for sid, cancelled in (("late-cancel", True), ("answered", False)):
            context = EndingContext()
            await servicer.Prefill(VerifierPrefillRequest(session_id=sid, prompt_ids=PROMPT), context)
            assert sid in servicer.sessions and context.callbacks
            context.end(cancelled)
        assert await eventually(lambda: "late-cancel" not in servicer.sessions)
        await asyncio.sleep(0.2)                        # the worker thread has nothing left to release
        assert "answered" in servicer.sessions and evicted(servicer) == set()
    finally:
        await server.stop()
