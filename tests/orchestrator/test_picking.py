"""The router's picking, probing and address parsing, unit level (no servers)."""

from __future__ import annotations

from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2

from specdec.request.errors import ResourceExhausted, Unavailable
from specdec.v1 import verifier_pb2
from orchestrator.routing import REPROBE_AFTER_S, SLOW_PROBES, Discovery, Pool, parse_addresses, split_address


# -- picking, unit level ----------------------------------------------------------------
def info(max_sessions, active=0):
    return verifier_pb2.VerifierGetInfoResponse(vocab_size=300, max_sessions=max_sessions, active_sessions=active)


@pytest.mark.asyncio
async def test_pick_is_least_loaded_relative_to_capacity_and_ties_are_random():
    pool = Pool("verifier", Discovery(("10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1")))
    a, b, c = pool.endpoints.values()
    for endpoint, cap in ((a, 4), (b, 2), (c, 8)):
        endpoint.probed(info(cap))
    a.pinned, b.pinned, c.pinned = 2, 1, 1          # loads 0.5, 0.5, 0.125
    picked, _ = pool.pick()
    assert picked is c and c.pinned == 2
    pool.unpin(c)
    c.pinned = 4                                      # all at 0.5: each is picked some of the time
    seen = Counter()
    for _ in range(60):
        e, _ = pool.pick()
        seen[e.address] += 1
        pool.unpin(e)
    assert set(seen) == {a.address, b.address, c.address}
    # other clients' sessions (from the last probe) count too
    a.pinned = b.pinned = c.pinned = 0
    a.probed(info(4, active=3))
    picked, _ = pool.pick(exclude=frozenset({b.address}))
    assert picked is c
    await pool.aclose()


@pytest.mark.asyncio
async def test_pick_skips_draining_unhealthy_and_misfit_endpoints_and_says_why():
    pool = Pool("verifier", Discovery(("10.0.0.1:1", "10.0.0.2:1")))
    a, b = pool.endpoints.values()
    with pytest.raises(Unavailable, match="no verifier is reachable"):
        pool.pick()                                   # never probed: not healthy
    a.probed(info(1))
    b.probed(info(1))
    b.pinned = 1
    a.draining = True                                 # least loaded, but leaving discovery
    with pytest.raises(ResourceExhausted, match="all 1 verifiers are at capacity"):
        pool.pick()
    a.draining = False
    a.problem = "vocabulary of 7 tokens"
    assert pool.pick(optional=True) == (None, "full")
    a.problem = None
    pool.failed(a, "connection refused")
    b.healthy = False
    assert pool.pick(optional=True) == (None, "unavailable")
    await pool.aclose()


class ProbeAnswers:
    """Stands in for one endpoint's GetInfo and health stubs: each probe takes
    the next outcome ("ok", "slow" = DEADLINE_EXCEEDED, "refused" = UNAVAILABLE)."""

    def __init__(self, endpoint, outcomes):
        self.outcomes = list(outcomes)
        self.calls = 0
        endpoint.stub = self
        endpoint.health = self

    async def GetInfo(self, request, timeout=None):
        self.calls += 1
        outcome = self.outcomes.pop(0)
        if outcome != "ok":
            code = grpc.StatusCode.DEADLINE_EXCEEDED if outcome == "slow" else grpc.StatusCode.UNAVAILABLE
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=outcome)
        return info(2)

    async def Check(self, request, timeout=None):
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@pytest.mark.asyncio
async def test_slow_probes_lose_an_endpoint_only_in_a_row_refused_at_once():
    pool = Pool("verifier", Discovery(("10.0.0.1:1", "10.0.0.2:1")))
    slow, refused = pool.endpoints.values()
    ProbeAnswers(slow, ["ok"] + ["slow"] * (SLOW_PROBES - 1) + ["ok"] + ["slow"] * SLOW_PROBES)
    ProbeAnswers(refused, ["ok", "refused"])
    await pool.probe()
    assert slow.healthy and refused.healthy
    await pool.probe()
    assert not refused.healthy                       # refused: lost at once
    for _ in range(SLOW_PROBES - 2):
        await pool._probe(slow, 1.0)
    assert slow.healthy                              # busy, not gone
    await pool._probe(slow, 1.0)                     # one good answer resets the count
    for _ in range(SLOW_PROBES):
        assert slow.healthy
        await pool._probe(slow, 1.0)
    assert not slow.healthy
    await pool.aclose()


@pytest.mark.asyncio
async def test_acquire_probes_unhealthy_endpoints_again_before_answering_unavailable():
    pool = Pool("verifier", Discovery(("10.0.0.1:1", "10.0.0.2:1")))
    back, gone = pool.endpoints.values()
    came_back = ProbeAnswers(back, ["ok"])
    still_gone = ProbeAnswers(gone, ["refused", "refused"])
    back.lost("probe timed out")
    gone.lost("connection refused")
    with pytest.raises(Unavailable):
        pool.pick()
    endpoint, _ = await pool.acquire()
    assert endpoint is back and back.pinned == 1 and came_back.calls == 1
    # nothing usable, and the last probe was just now: answered without probing again
    back.lost("connection refused")
    assert await pool.acquire(optional=True) == (None, "unavailable")
    assert still_gone.calls == 1
    gone.probed_at -= 10 * REPROBE_AFTER_S
    with pytest.raises(Unavailable, match="no verifier is reachable"):
        await pool.acquire(exclude=frozenset({back.address}))
    assert still_gone.calls == 2
    await pool.aclose()


def test_addresses_parse_from_repeated_and_comma_separated_flags():
    assert parse_addresses(["a:1,b:2", "c:3", "a:1"]) == ("a:1", "b:2", "c:3")
    assert parse_addresses("x:5") == ("x:5",)
    assert split_address("[::1]:50051") == ("::1", 50051)
    for bad in ("nohost", "host:", ":80", "host:99999", "host:http"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_addresses([bad])
