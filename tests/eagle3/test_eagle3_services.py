"""EAGLE-3 through the services: the drafter reports its feature layers, the
orchestrator asks the verifier for them, one verifier serves EAGLE-2 and
EAGLE-3 sessions (batched together too), and a lost EAGLE-3 drafter is
replaced without changing a token."""

import threading
import time

import grpc
import pytest
import torch

from running_stack import Stack
from serving.helpers import channel_to, rpc_error
from specdec.client import SpecdecClient
from specdec.serving import tensor_wire
from specdec.serving.metrics import REGISTRY
from specdec.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2
from specdec.v1.verifier_pb2_grpc import VerifierServiceStub
from eagle3_family import add_eagle3_drafter
from running_stack import start_orchestrator

PROMPT = "def add(a, b):"
N = 32


class Held:
    """Counts an engine method's calls per session (``draft`` of a drafter,
    ``verify`` of a verifier); holds the calls after the first ``after`` until ``open``."""

    def __init__(self, engine, method: str, after: int | None = None):
        self.engine, self.method, self.original = engine, method, getattr(engine, method)
        self.sessions: list[str] = []
        self.after, self.held = after, threading.Event()
        self.release = threading.Event()

        def call(sid, *args, **kw):
            self.sessions.append(sid)
            if self.after is not None and len(self.sessions) > self.after:
                self.held.set()
                self.release.wait(30)
            return self.original(sid, *args, **kw)

        setattr(engine, method, call)

    def open(self) -> None:
        self.release.set()

    def restore(self) -> None:
        self.open()
        setattr(self.engine, self.method, self.original)


def generate_in_background(client, results: list, **params) -> threading.Thread:
    def consume():
        results.append(client.complete(PROMPT, **params))
    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    return thread


def add_orchestrator(stack: Stack, name: str, verifiers: list[str], drafters: list[str]):
    stack.servers[name] = stack.loop.run(start_orchestrator(
        ",".join(stack.address(v) for v in verifiers), ",".join(stack.address(d) for d in drafters),
        stack.paths["target"]))


def stop_if_running(stack: Stack, *names: str) -> None:
    for name in names:
        if name in stack.servers:
            stack.stop(name)


FALLBACK_REASONS = ("drafter_error", "drafters_unavailable", "features")


def fallbacks(reasons=FALLBACK_REASONS) -> float:
    return sum(REGISTRY.get_sample_value("specdec_fallback_total", {"reason": r}) or 0.0 for r in reasons)


@pytest.fixture(scope="module")
def stack(family3):
    s = Stack(family3)
    s.add_verifier("v")
    s.add_verifier("v-batched", batch_window_ms=20)
    add_eagle3_drafter(s, "d3")
    add_eagle3_drafter(s, "d3-batched", batch_window_ms=20)
    s.add_drafter("d2", "eagle")
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(stack):
    return stack.plain_output(PROMPT, N)


def test_drafter_reports_its_layers_and_the_verifier_returns_them(stack):
    drafter = stack.servicer("d3").drafter

    async def run():
        async with channel_to(stack.servers["d3"][0]) as ch:
            info = await drafter_pb2_grpc.DrafterServiceStub(ch).GetInfo(drafter_pb2.DrafterGetInfoRequest())
        async with channel_to(stack.servers["v"][0]) as ch:
            stub = VerifierServiceStub(ch)
            vinfo = await stub.GetInfo(verifier_pb2.VerifierGetInfoRequest())
            first = await stub.Prefill(verifier_pb2.VerifierPrefillRequest(
                session_id="layers", prompt_ids=[5, 6, 7, 8], return_features=True,
                feature_layers=info.feature_layers))
            await stub.Release(verifier_pb2.VerifierReleaseRequest(session_id="layers"))
            bad = await rpc_error(stub.Prefill(verifier_pb2.VerifierPrefillRequest(
                session_id="bad", prompt_ids=[5, 6], return_features=True, feature_layers=[0, vinfo.num_layers])))
        return info, first, bad

    info, first, bad = stack.loop.run(run())
    assert info.kind == "eagle3" and info.needs_features
    assert tuple(info.feature_layers) == drafter.feature_layers
    assert list(first.features.shape) == [4, drafter.feature_size]
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "feature_layers" in bad.details()


def test_drafter_refuses_features_of_the_wrong_width(stack):
    drafter = stack.servicer("d3").drafter
    narrow = tensor_wire.tensor_to_proto(torch.zeros(2, drafter.hidden_size))

    async def run():
        async with channel_to(stack.servers["d3"][0]) as ch:
            return await rpc_error(drafter_pb2_grpc.DrafterServiceStub(ch).Prefill(
                drafter_pb2.DrafterPrefillRequest(session_id="w", token_ids=[1, 2, 3], features=narrow)))

    err = stack.loop.run(run())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and str(drafter.feature_size) in err.details()


@pytest.mark.parametrize("verifier,drafter", [("v", "d3"), ("v-batched", "d3-batched")])
def test_one_verifier_serves_eagle2_and_eagle3_sessions(stack, reference, verifier, drafter):
    """Concurrent EAGLE-2 and EAGLE-3 sessions on one verifier; with batch
    windows, the verifies and the EAGLE-3 drafts of concurrent sessions batched."""
    add_orchestrator(stack, "o3", [verifier], [drafter])
    add_orchestrator(stack, "o2", [verifier], ["d2"])
    try:
        before = fallbacks()
        with SpecdecClient(stack.address("o3"), timeout=60) as c3, \
                SpecdecClient(stack.address("o2"), timeout=60) as c2:
            results: list = []
            threads = [generate_in_background(c, results, max_new_tokens=N) for c in (c3, c2, c3, c2)]
            for thread in threads:
                thread.join(60)
        assert len(results) == 4 and all(r.token_ids == reference for r in results)
        assert fallbacks() == before              # every request drafted to the end
    finally:
        stack.stop("o3")
        stack.stop("o2")
    assert stack.wait_sessions_closed(verifier, drafter, "d2") == {verifier: 0, drafter: 0, "d2": 0}


def run_losing_a_drafter(stack: Stack, names: list[str]) -> tuple[list, str, dict]:
    return run_losing(stack, ["v"], names, {n: Held(stack.servicer(n).drafter, "draft", after=4) for n in names})


def run_losing(stack: Stack, verifiers: list[str], drafters: list[str],
               taps: dict[str, Held]) -> tuple[list, str, dict]:
    """A generation through an orchestrator over ``verifiers`` and ``drafters``;
    the server a call is held in by its tap (after a few cycles) is stopped with
    it in flight. Returns the completions, the victim and the taps."""
    add_orchestrator(stack, "of", verifiers, drafters)
    names = list(taps)
    try:
        with SpecdecClient(stack.address("of"), timeout=60) as client:
            results: list = []
            thread = generate_in_background(client, results, max_new_tokens=N)
            deadline = time.monotonic() + 30
            while not any(taps[n].held.is_set() for n in names):
                assert time.monotonic() < deadline, "no call was held"
                time.sleep(0.01)
            victim = next(n for n in names if taps[n].held.is_set())
            stack.stop(victim)                    # a call is in flight there
            for tap in taps.values():
                tap.open()
            thread.join(60)
    finally:
        for tap in taps.values():
            tap.restore()
        stack.stop("of")
    return results, victim, taps


@pytest.mark.timeout(120)
def test_lost_eagle3_drafter_is_replaced_by_another(stack, reference):
    """The pinned EAGLE-3 drafter goes away with a Draft in flight: another one
    is prefilled with every committed token and feature row, and drafting goes on."""
    add_eagle3_drafter(stack, "d3a")
    add_eagle3_drafter(stack, "d3b")
    before = fallbacks()
    results, victim, taps = run_losing_a_drafter(stack, ["d3a", "d3b"])
    other = next(n for n in taps if n != victim)
    assert results and results[0].token_ids == reference
    assert taps[other].sessions and fallbacks() == before
    stop_if_running(stack, other)


@pytest.mark.timeout(120)
def test_a_drafter_reading_other_layers_never_takes_the_session_over(stack, reference):
    """EAGLE-3 and EAGLE-2 drafters in one pool: whichever the session started
    on, the other cannot continue it (its features come from other layers), so
    losing the first means plain decoding, with the same tokens."""
    add_eagle3_drafter(stack, "d3c")
    stack.add_drafter("d2c", "eagle")
    before, unavailable = fallbacks(), fallbacks(["drafters_unavailable"])
    results, victim, taps = run_losing_a_drafter(stack, ["d3c", "d2c"])
    other = next(n for n in taps if n != victim)
    assert results and results[0].token_ids == reference
    assert not taps[other].sessions and stack.servicer(other).stats.active == 0
    # refused by the router for its layers, not tried and failed
    assert fallbacks() == before + 1 and fallbacks(["drafters_unavailable"]) == unavailable + 1
    stop_if_running(stack, other)


@pytest.mark.timeout(120)
def test_lost_verifier_resumes_with_the_drafters_layers(stack, reference):
    """The verifier goes away with a Verify in flight: the session resumes on
    another one, which must return the same layers' features from then on (the
    drafter would refuse others and the request would fall back to plain
    decoding)."""
    stack.add_verifier("va")
    stack.add_verifier("vb")
    add_eagle3_drafter(stack, "d3v")
    before = fallbacks()
    taps = {n: Held(stack.servicer(n).engine, "verify", after=4) for n in ("va", "vb")}
    results, victim, taps = run_losing(stack, ["va", "vb"], ["d3v"], taps)
    other = next(n for n in taps if n != victim)
    assert results and results[0].token_ids == reference
    assert taps[other].sessions and fallbacks() == before
    stop_if_running(stack, "va", "vb", "d3v")
