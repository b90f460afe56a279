"""Routing over several verifiers and drafters (orchestrator.routing): least
loaded picks, sessions pinned to one backend of each role, load shedding with
RESOURCE_EXHAUSTED, plain decoding when every drafter is full, discovery
through DNS (re-resolved, vanished addresses drained). Real servers on
127.0.0.1, port 0; engine calls are held at a gate where a test needs
sessions to stay open."""

import asyncio
import threading
import time

import pytest

from running_stack import Stack, Tap, start_orchestrator
from specdec.client import SpecdecClient, SpecdecResourceExhausted
from specdec.serving.metrics import REGISTRY

PROMPT = "class Point:"
N = 24


class Background:
    """A generation consumed on a thread (a stream's first chunk may wait for
    later tokens: text is released by whole characters)."""

    def __init__(self, client, prompt=PROMPT, **params):
        self.stream = client.generate(prompt, **params)
        self.error = None
        self.thread = threading.Thread(target=self._consume, daemon=True)
        self.thread.start()

    def _consume(self):
        try:
            for _ in self.stream:
                pass
        except Exception as exc:
            self.error = exc

    def result(self, timeout=60.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the generation did not end"
        if self.error is not None:
            raise self.error
        return self.stream


def verifier_tap(stack, name):
    return Tap(stack.servicer(name).engine, "verify")


def drafter_tap(stack, name):
    return Tap(stack.servicer(name).drafter, "draft")


def add_orchestrator(stack, name, verifiers, drafters=(), **cfg):
    stack.servers[name] = stack.loop.run(start_orchestrator(
        ",".join(stack.address(v) for v in verifiers), ",".join(stack.address(d) for d in drafters) or None,
        stack.paths["target"], **cfg))
    return stack.servicer(name)


def sample(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


def wait_for(predicate, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def stack(tiny_family):
    s = Stack(tiny_family)
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(stack):
    """The greedy output of PROMPT on one undisturbed verifier, plain decoding."""
    return stack.plain_output(PROMPT, N)


# -- real servers ---------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_sessions_spread_to_the_least_loaded_and_stay_pinned(stack, reference):
    for name in ("v1", "v2"):
        stack.add_verifier(name, max_sessions=4)
    for name in ("d1", "d2"):
        stack.add_drafter(name, "eagle", max_sessions=4)
    add_orchestrator(stack, "spread", ["v1", "v2"], ["d1", "d2"])
    taps = [verifier_tap(stack, v) for v in ("v1", "v2")] + [drafter_tap(stack, d) for d in ("d1", "d2")]
    try:
        for tap in taps[:2]:
            tap.close()
        with SpecdecClient(stack.address("spread"), timeout=60) as client:
            first = Background(client, max_new_tokens=N)
            # prefilled on one verifier, held at its first Verify
            wait_for(lambda: sum(stack.open_sessions("v1", "v2").values()) == 1, what="the first session")
            second = Background(client, max_new_tokens=N)
            # the second session went where the first was not: one per verifier, one per drafter
            assert stack.wait_sessions("v1", "v2", "d1", "d2", count=1) == {"v1": 1, "v2": 1, "d1": 1, "d2": 1}
            for tap in taps[:2]:
                tap.open()
            outputs = []
            for gen in (first, second):
                stream = gen.result()
                outputs.append(stream.token_ids)
                assert stream.stats.draft_tokens > 0
        assert outputs == [reference, reference]
        # every Verify of a session went to one verifier, every Draft to one drafter
        for pair in (taps[:2], taps[2:]):
            owners = [set(t.sessions) for t in pair]
            assert all(owners) and not owners[0] & owners[1], owners
        assert stack.wait_sessions_closed("v1", "v2", "d1", "d2") == {"v1": 0, "v2": 0, "d1": 0, "d2": 0}
        router = stack.servicer("spread").router
        assert all(e.pinned == 0 for pool in router.pools for e in pool.endpoints.values())
    finally:
        for tap in taps:
            tap.restore()
        for name in ("spread", "v1", "v2", "d1", "d2"):
            stack.stop(name)


@pytest.mark.timeout(120)
def test_all_verifiers_full_is_resource_exhausted_until_one_frees(stack, reference):
    for name in ("full-1", "full-2"):
        stack.add_verifier(name, max_sessions=1)
    add_orchestrator(stack, "full", ["full-1", "full-2"])
    taps = [verifier_tap(stack, v) for v in ("full-1", "full-2")]
    try:
        for tap in taps:
            tap.close()
        with SpecdecClient(stack.address("full"), timeout=60) as client:
            held = [Background(client, max_new_tokens=N) for _ in range(2)]
            assert stack.wait_sessions("full-1", "full-2", count=1) == {"full-1": 1, "full-2": 1}
            t0 = time.monotonic()
            with pytest.raises(SpecdecResourceExhausted) as err:
                client.complete(PROMPT, max_new_tokens=N)
            assert "all 2 verifiers are at capacity" in err.value.details
            assert time.monotonic() - t0 < 5                  # shed at once, not queued
            for tap in taps:
                tap.open()
            for gen in held:
                assert gen.result().token_ids == reference
            router = stack.servicer("full").router
            wait_for(lambda: all(e.pinned == 0 for e in router.verifiers.endpoints.values()), what="unpinning")
            assert client.complete(PROMPT, max_new_tokens=N).token_ids == reference
    finally:
        for tap in taps:
            tap.restore()
        for name in ("full", "full-1", "full-2"):
            stack.stop(name)


@pytest.mark.timeout(120)
def test_all_drafters_full_runs_plain_decoding_and_counts_it(stack, reference):
    stack.add_verifier("pv", max_sessions=4)
    stack.add_drafter("pd", "eagle", max_sessions=1)
    add_orchestrator(stack, "plain", ["pv"], ["pd"])
    tap = drafter_tap(stack, "pd")
    before = sample("specdec_fallback_total", reason="drafters_full")
    try:
        tap.close()
        with SpecdecClient(stack.address("plain"), timeout=60) as client:
            held = Background(client, max_new_tokens=N)
            wait_for(lambda: tap.held, what="the first session's draft")
            second = client.complete(PROMPT, max_new_tokens=N)
            assert second.token_ids == reference
            assert second.stats.draft_tokens == 0 and second.stats.tau == 1.0
            assert sample("specdec_fallback_total", reason="drafters_full") == before + 1
            tap.open()
            stream = held.result()
            assert stream.token_ids == reference and stream.stats.draft_tokens > 0
    finally:
        tap.restore()
        for name in ("plain", "pv", "pd"):
            stack.stop(name)


@pytest.mark.timeout(120)
def test_dns_name_is_resolved_and_resolved_again(stack, reference):
    verifier, _ = stack.add_verifier("dns-v")
    drafter, _ = stack.add_drafter("dns-d", "eagle")
    servicer = add_orchestrator(stack, "dns", [], [], verifier_dns=f"localhost:{verifier.port}",
                                drafter_dns=f"localhost:{drafter.port}", resolve_interval_s=0.05)
    router = servicer.router
    lookups = []
    for pool in router.pools:
        real = pool._resolver

        async def counting(host, port, real=real):
            lookups.append(host)
            return await real(host, port)

        pool._resolver = counting
    try:
        for pool, port in ((router.verifiers, verifier.port), (router.drafters, drafter.port)):
            assert f"127.0.0.1:{port}" in [e.address for e in pool.usable()]
        wait_for(lambda: len(lookups) >= 6, timeout=10, what="lookups again")
        assert set(lookups) == {"localhost"}
        with SpecdecClient(stack.address("dns"), timeout=60) as client:
            got = client.complete(PROMPT, max_new_tokens=N)
        assert got.token_ids == reference and got.stats.draft_tokens > 0
    finally:
        for name in ("dns", "dns-v", "dns-d"):
            stack.stop(name)


@pytest.mark.timeout(120)
def test_address_leaving_dns_is_drained_its_sessions_finish(stack, tiny_family, reference):
    """The name first answers A, then only B: A takes no new session, the one it
    holds runs to the end, then A is dropped."""
    from orchestrator.service import OrchestratorConfig, OrchestratorService
    from orchestrator.text import TextTokenizer
    from specdec.serving.server import ServerConfig, start_server

    stack.add_verifier("drain-a")
    stack.add_verifier("drain-b")
    a, b = stack.address("drain-a"), stack.address("drain-b")
    answer = {"verifiers.test": [a]}

    async def resolver(host, port):
        return list(answer[host])

    async def start():
        config = OrchestratorConfig(verifier_dns="verifiers.test:50051", resolve_interval_s=0.05,
                                    probe_interval_s=0.05)
        servicer = OrchestratorService(config, TextTokenizer.load(tiny_family["target"]), resolver=resolver)
        server = await start_server(ServerConfig(metrics_port=None), [servicer.registration()], "orchestrator")
        await asyncio.wait_for(servicer.connect(retry_s=0.05), 30)
        server.set_ready(True)
        return server, servicer

    stack.servers["drain"] = stack.loop.run(start())
    pool = stack.servicer("drain").router.verifiers
    tap_a, tap_b = verifier_tap(stack, "drain-a"), verifier_tap(stack, "drain-b")
    try:
        tap_a.close()
        with SpecdecClient(stack.address("drain"), timeout=60) as client:
            held = Background(client, max_new_tokens=N)
            assert stack.wait_sessions("drain-a", count=1) == {"drain-a": 1}
            answer["verifiers.test"] = [b]
            wait_for(lambda: b in pool.endpoints and pool.endpoints[a].draining, what="A draining")
            wait_for(lambda: pool.endpoints[b].usable, what="B usable")
            for _ in range(3):
                assert client.complete(PROMPT, max_new_tokens=N).token_ids == reference
            assert tap_b.sessions and a in pool.endpoints        # A still serves its session
            tap_a.open()
            assert held.result().token_ids == reference
        wait_for(lambda: a not in pool.endpoints, what="A dropped after its last session")
    finally:
        tap_a.restore()
        tap_b.restore()
        for name in ("drain", "drain-a", "drain-b"):
            stack.stop(name)


@pytest.mark.timeout(60)
def test_drafter_with_another_vocabulary_is_refused_at_once(stack):
    from drafter.ngram import NgramDrafter
    from drafter.service import DrafterService
    from specdec.serving.server import ServerConfig, start_server

    async def start_misfit():
        servicer = DrafterService()
        server = await start_server(ServerConfig(metrics_port=None), [servicer.registration()], "drafter")
        await servicer.load(lambda: NgramDrafter(7))
        server.set_ready(True)
        return server, servicer

    stack.add_verifier("vocab-v")
    stack.servers["vocab-d"] = stack.loop.run(start_misfit())
    add_orchestrator(stack, "vocab", ["vocab-v"], ["vocab-d"], connect=False)
    try:
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="vocabulary of 7 tokens"):
            stack.loop.run(stack.servicer("vocab").connect(retry_s=0.05))
        assert time.monotonic() - t0 < 10           # not after the wait for a drafter to come up
    finally:
        for name in ("vocab", "vocab-v", "vocab-d"):
            stack.stop(name)


@pytest.mark.timeout(60)
def test_draining_verifier_gets_no_new_sessions(stack, reference):
    """SIGTERM's drain turns readiness off: the probe sees it and new sessions
    go elsewhere without first being refused there."""
    names = ("drain-x", "drain-y")
    for name in names:
        stack.add_verifier(name)
    add_orchestrator(stack, "drains", names, probe_interval_s=0.05)
    router = stack.servicer("drains").router
    taps = {name: verifier_tap(stack, name) for name in names}
    refused = sample("specdec_rpcs_total", service="specdec.v1.VerifierService", method="Prefill",
                     code="UNAVAILABLE")
    try:
        for tap in taps.values():
            tap.close()
        with SpecdecClient(stack.address("drains"), timeout=60) as client:
            held = Background(client, max_new_tokens=N)
            wait_for(lambda: any(t.held for t in taps.values()), what="a held session")
            busy = next(name for name in names if taps[name].held)
            calm = next(name for name in names if name != busy)
            taps[calm].open()
            endpoint = router.verifiers.endpoints[stack.address(busy)]
            # drain: readiness off, the open session gets up to 30 s
            asyncio.run_coroutine_threadsafe(stack.servers[busy][0].stop(30), stack.loop.loop)
            wait_for(lambda: not endpoint.healthy, what="the probe to see the drain")
            for _ in range(3):
                assert client.complete(PROMPT, max_new_tokens=N).token_ids == reference
            taps[busy].open()
            assert held.result().token_ids == reference          # the open session finished there
        assert sample("specdec_rpcs_total", service="specdec.v1.VerifierService", method="Prefill",
                      code="UNAVAILABLE") == refused
        assert len(set(taps[busy].sessions)) == 1 and len(set(taps[calm].sessions)) == 3
    finally:
        for tap in taps.values():
            tap.restore()
        for name in ("drains", *names):
            stack.stop(name)


def test_shared_tree_tokens_split_the_budget_with_a_floor():
    from specdec.request.speculative import MIN_SHARED_TREE, shared_tree_tokens
    from orchestrator.service import OrchestratorConfig

    assert [shared_tree_tokens(64, s) for s in (0, 1, 2, 4, 8, 64)] == [64, 64, 32, 16, 8, MIN_SHARED_TREE]
    with pytest.raises(ValueError, match="verify token budget"):
        OrchestratorConfig(verifier="127.0.0.1:1", verify_token_budget=-1)


@pytest.mark.timeout(120)
def test_verify_token_budget_cuts_trees_and_keeps_the_output(stack, reference):
    stack.add_verifier("vb")
    stack.add_drafter("db", "eagle")
    add_orchestrator(stack, "budget", ["vb"], ["db"], verify_token_budget=6)
    drafter = stack.servicer("db").drafter
    original, sizes = drafter.draft, []

    def recording(sid, cfg):
        sizes.append(cfg.total_tokens)
        return original(sid, cfg)

    drafter.draft = recording
    try:
        with SpecdecClient(stack.address("budget"), timeout=60) as client:
            result = client.complete(PROMPT, max_new_tokens=N, total_tokens=16)
        assert result.token_ids == reference
        assert sizes and all(size == 6 for size in sizes), sizes      # one session: the whole budget
    finally:
        drafter.draft = original
        for name in ("budget", "vb", "db"):
            stack.stop(name)
