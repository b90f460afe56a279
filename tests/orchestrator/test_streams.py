"""Session streams (orchestrator.backend, specdec.serving.engine_servicer): every
per-cycle step of a session on one bidirectional stream per backend.

- through the services, greedy output equals plain decoding and a seeded
  sampled request repeats itself and matches the unary-steps orchestrator;
  the steps went over Session streams (no unary Verify / Draft / Release);
- a stream broken mid-request (the backend ends it UNAVAILABLE) moves the
  session, with no committed token lost, and the broken stream's session is
  released where it was;
- on a backend: half-closing the stream releases its session, cancelling it
  (a lost orchestrator) too, and a stream that does not open with one prefill
  of its own session is INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from running_stack import Stack, start_orchestrator
from serving.helpers import channel_to, rpc_error, start_verifier

from specdec.client import SpecdecClient
from specdec.request import wire
from specdec.request.errors import Unavailable
from specdec.request.params import SamplingParams
from specdec.request.speculative import Draft
from specdec.serving import tensor_wire
from specdec.serving.metrics import REGISTRY
from specdec.tree.build import tree_from_lists
from specdec.v1 import verifier_pb2
from specdec.v1.verifier_pb2_grpc import VerifierServiceStub
from orchestrator.backend import BackendError, Deadline
from orchestrator.failover import RemoteVerifier
from orchestrator.lease import Leases
from orchestrator.routing import Discovery, Pool

PROMPT = "class Point:"
N = 40
VERIFIER = "specdec.v1.VerifierService"
DRAFTER = "specdec.v1.DrafterService"


def served(service: str, method: str) -> float:
    """RPCs of ``method`` this process's servers answered, any status."""
    return sum(REGISTRY.get_sample_value("specdec_rpcs_total", {"service": service, "method": method, "code": code})
               or 0.0 for code in ("OK", "CANCELLED", "UNAVAILABLE", "NOT_FOUND", "INVALID_ARGUMENT"))


@pytest.fixture(scope="module")
def stack(tiny_family):
    s = Stack(tiny_family)
    s.add_verifier("verifier")
    s.add_drafter("drafter", "eagle")
    # the relay plane's steps (the direct plane's own streams: test_direct_plane.py)
    s.add_orchestrator("streams", drafter="drafter", plane="relay")
    s.add_orchestrator("unary", drafter="drafter", session_streams=False, plane="relay")
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(stack):
    return stack.plain_output(PROMPT, N)


def test_greedy_over_streams_is_plain_decoding_and_no_step_is_unary(stack, reference):
    unary = {(s, m): served(s, m) for s, m in ((VERIFIER, "Verify"), (VERIFIER, "Prefill"), (VERIFIER, "Release"),
                                               (DRAFTER, "Draft"), (DRAFTER, "Prefill"), (DRAFTER, "Release"))}
    sessions = served(VERIFIER, "Session"), served(DRAFTER, "Session")
    with SpecdecClient(stack.address("streams"), timeout=60) as client:
        done = client.complete(PROMPT, max_new_tokens=N, method="eagle2")
    assert done.token_ids == reference
    assert done.stats.cycles < N and done.stats.draft_tokens > 0          # it drafted
    # a Verify answer carries at least its committed tokens packed, and every Draft a tree
    assert done.stats.wire_bytes > done.stats.cycles * 8
    assert (served(VERIFIER, "Session"), served(DRAFTER, "Session")) == (sessions[0] + 1, sessions[1] + 1)
    assert {k: served(*k) for k in unary} == unary
    assert stack.wait_sessions_closed("verifier", "drafter") == {"verifier": 0, "drafter": 0}


def test_unary_steps_give_the_same_tokens(stack, reference):
    verifies = served(VERIFIER, "Verify")
    with SpecdecClient(stack.address("unary"), timeout=60) as client:
        done = client.complete(PROMPT, max_new_tokens=N, method="eagle2")
    assert done.token_ids == reference
    assert served(VERIFIER, "Verify") == verifies + done.stats.cycles


def test_seeded_sampling_over_streams_repeats_and_matches_unary_steps(stack):
    params = dict(max_new_tokens=N, method="eagle2", temperature=1.0, seed=1234)
    with SpecdecClient(stack.address("streams"), timeout=60) as client:
        first, again = client.complete(PROMPT, **params), client.complete(PROMPT, **params)
        other = client.complete(PROMPT, **{**params, "seed": 99})
    with SpecdecClient(stack.address("unary"), timeout=60) as client:
        unary = client.complete(PROMPT, **params)
    assert first.token_ids == again.token_ids == unary.token_ids
    assert other.token_ids != first.token_ids


# -- a stream broken mid-request -------------------------------------------------------------------
def break_once(monkeypatch, servicers, method: str, after: int) -> dict:
    """The ``after``-th call of ``method`` over ``servicers`` ends its stream UNAVAILABLE."""
    seen = {"calls": 0, "broken": []}

    def breaking(servicer, original):
        async def step(request, context):
            seen["calls"] += 1
            if seen["calls"] == after:
                seen["broken"].append(servicer)
                raise Unavailable("the stream broke (test)")
            return await original(request, context)
        return step

    for servicer in servicers:
        monkeypatch.setattr(servicer, method, breaking(servicer, getattr(servicer, method)))
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("role", ["verifier", "drafter"])
def test_broken_stream_moves_the_session_and_loses_no_token(stack, reference, monkeypatch, role):
    names = ["bv1", "bv2"] if role == "verifier" else ["bd1", "bd2"]
    for name in names:
        if role == "verifier":
            stack.add_verifier(name)
        else:
            stack.add_drafter(name, "eagle")
    verifiers = names if role == "verifier" else ["verifier"]
    drafters = names if role == "drafter" else ["drafter"]
    stack.servers["broken"] = stack.loop.run(_orchestrator(stack, verifiers, drafters))
    method = "Verify" if role == "verifier" else "Draft"
    seen = break_once(monkeypatch, [stack.servicer(n) for n in names], method, after=5)
    moved = REGISTRY.get_sample_value("specdec_failovers_total", {"role": role}) or 0.0
    try:
        with SpecdecClient(stack.address("broken"), timeout=60) as client:
            done = client.complete(PROMPT, max_new_tokens=N, method="eagle2")
        assert done.token_ids == reference
        assert done.stats.completion_tokens == N
        assert len(seen["broken"]) == 1 and seen["calls"] > 5
        assert REGISTRY.get_sample_value("specdec_failovers_total", {"role": role}) == moved + 1
        assert stack.wait_sessions_closed(*names) == {n: 0 for n in names}
    finally:
        for name in ["broken", *names]:
            stack.stop(name)


async def _orchestrator(stack, verifiers, drafters):
    return await start_orchestrator(",".join(stack.address(v) for v in verifiers),
                                    ",".join(stack.address(d) for d in drafters), stack.paths["target"])


# -- the stream on a backend ---------------------------------------------------------------------
def prefill(sid: str, prompt: list[int]) -> verifier_pb2.VerifierSessionRequest:
    return verifier_pb2.VerifierSessionRequest(prefill=verifier_pb2.VerifierPrefillRequest(
        session_id=sid, prompt_ids=prompt, sampling=wire.sampling_to_proto(SamplingParams())))


def verify(root: int, sid: str = "") -> verifier_pb2.VerifierSessionRequest:
    tree = tensor_wire.tree_to_proto(tree_from_lists([root], [-1]))
    return verifier_pb2.VerifierSessionRequest(verify=verifier_pb2.VerifyRequest(session_id=sid, tree=tree))


async def wait_empty(servicer, timeout: float = 5.0) -> int:
    for _ in range(int(timeout / 0.02)):
        if len(servicer.sessions) == 0:
            return 0
        await asyncio.sleep(0.02)
    return len(servicer.sessions)


@pytest.mark.asyncio
async def test_stream_end_releases_the_session_however_it_ends(tiny_family):
    server, servicer = await start_verifier(tiny_family, metrics_port=None)
    try:
        async with channel_to(server) as channel:
            stub = VerifierServiceStub(channel)
            for ending in ("half-close", "cancel"):
                call = stub.Session(timeout=30)
                await call.write(prefill(f"s-{ending}", [5, 17, 42, 8]))
                token = (await call.read()).prefill.token
                await call.write(verify(token))
                answer = await call.read()
                assert answer.WhichOneof("step") == "verify" and len(answer.verify.tokens) == 1
                assert len(servicer.sessions) == 1
                if ending == "half-close":
                    await call.done_writing()
                    assert await call.read() == grpc.aio.EOF
                    assert await call.code() == grpc.StatusCode.OK
                    assert len(servicer.sessions) == 0               # released before the stream ended
                else:
                    call.cancel()
                    assert await wait_empty(servicer) == 0
    finally:
        await server.stop()


@pytest.mark.asyncio
async def test_stream_opens_with_one_prefill_of_its_own_session(tiny_family):
    server, servicer = await start_verifier(tiny_family, metrics_port=None)
    try:
        async with channel_to(server) as channel:
            stub = VerifierServiceStub(channel)
            cases = [([verify(3)], "opens with one prefill"),
                     ([prefill("a", [5, 17]), prefill("b", [5, 17])], "opens with one prefill"),
                     ([prefill("a", [5, 17]), verify(3, sid="other")], "on the stream of session"),
                     ([verifier_pb2.VerifierSessionRequest()], "needs one of")]
            for messages, match in cases:
                call = stub.Session(timeout=30)
                for message in messages:
                    await call.write(message)
                err = await rpc_error(_drain(call))
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and match in err.details(), err.details()
                assert await wait_empty(servicer) == 0
    finally:
        await server.stop()


async def _drain(call) -> None:
    while await call.read() != grpc.aio.EOF:
        pass


@pytest.mark.asyncio
async def test_a_step_after_the_streams_deadline_is_deadline_exceeded(tiny_family):
    """The stream carries the request's deadline; a step written after it has
    passed (the call already over) fails with that status, which the loop
    answers as a timeout, and the session is still released."""
    server, servicer = await start_verifier(tiny_family, metrics_port=None)
    pool = Pool("verifier", Discovery(static=(f"127.0.0.1:{server.port}",)))
    try:
        backend = RemoteVerifier(pool, "late", Deadline(1.0), Leases())
        await backend.pin()
        first = await backend.prefill([5, 17, 42, 8], SamplingParams(), 16, features=False)
        for _ in range(200):                         # the call ends at its deadline, client side
            if backend.stream.done():
                break
            await asyncio.sleep(0.02)
        assert backend.stream.done()
        tree = tensor_wire.tree_to_proto(tree_from_lists(first.tokens, [-1]))
        with pytest.raises(BackendError) as raised:
            await backend.verify(Draft(tree, 1), features=False)
        assert raised.value.status == grpc.StatusCode.DEADLINE_EXCEEDED
        await backend.release()
        assert await wait_empty(servicer) == 0
    finally:
        for endpoint in pool.endpoints.values():
            await endpoint.channel.close()
        await server.stop()


@pytest.mark.asyncio
async def test_any_failure_past_the_deadline_is_deadline_exceeded():
    """A step that races the stream's end at the deadline can see INTERNAL
    from the transport; the session takes it for what it is, a timeout (before
    the deadline the transport's status stands)."""
    core = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                "Internal error from Core")
    pool = Pool("verifier", Discovery(static=("127.0.0.1:1",)))
    for timeout, status in ((-1.0, grpc.StatusCode.DEADLINE_EXCEEDED), (60.0, grpc.StatusCode.INTERNAL),
                            (None, grpc.StatusCode.INTERNAL)):
        backend = RemoteVerifier(pool, "s", Deadline(timeout), Leases())
        backend.endpoint = pool.endpoints["127.0.0.1:1"]
        assert backend.failure("Verify", core).status == status
    await pool.endpoints["127.0.0.1:1"].channel.close()
