"""Failover, nothing lost (orchestrator.failover, orchestrator.loop).

- the feature log: concatenated bytes are ``torch.cat`` of the rows, and a
  drafter prefilled from them drafts what the incrementally fed one drafts;
- ``Prefill(resume=True)`` over gRPC continues a session exactly;
- in-process servers: a drafter or verifier stopped (or forgetting the
  session) while a call is held in it; the request moves and its greedy output
  is unchanged; the errors that must not move a session don't;
- real processes (``specdec up --drafters 2 --verifiers 2 --state FILE``): the
  pinned drafter, then the pinned verifier, then every drafter SIGKILLed
  mid-generation; the SDK sees no error and the same tokens as undisturbed.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from specdec.request.wire import FeatureLog
from running_stack import Stack, alive
from serving.helpers import channel_to, drafter_builder, rpc_error, start_verifier, verifier_builder
from specdec.client import SpecdecClient, SpecdecClientError, SpecdecUnavailable
from specdec.request import wire
from specdec.request.errors import FailedPrecondition, SpecdecError
from specdec.request.params import SamplingParams
from specdec.request.params import TreeParams
from specdec.serving import tensor_wire
from specdec.serving.metrics import REGISTRY
from specdec.tree.build import tree_from_lists
from specdec.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2
from specdec.v1.verifier_pb2_grpc import VerifierServiceStub
from running_stack import Tap
from test_routing import Background, add_orchestrator, wait_for

PROMPT = "class Point:"
N = 40


def sample(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


# -- the feature log --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_feature_log_bytes_concatenate_like_torch_cat(dtype):
    torch.manual_seed(0)
    parts = [torch.randn(rows, 6) for rows in (5, 1, 3, 2)]
    log = FeatureLog()
    for part in parts:
        log.add(tensor_wire.tensor_to_proto(part, dtype))
    msg = log.tensor()
    assert list(msg.shape) == [11, 6] and msg.dtype == dtype and log.rows == 11
    want = torch.cat(parts).to(getattr(torch, dtype))
    assert torch.equal(tensor_wire.tensor_from_proto(msg), want)
    log.clear()
    assert log.tensor() is None


def test_feature_log_refuses_rows_that_do_not_continue():
    log = FeatureLog()
    log.add(tensor_wire.tensor_to_proto(torch.zeros(2, 4)))
    for bad, match in ((tensor_wire.tensor_to_proto(torch.zeros(1, 5)), "changed"),
                       (tensor_wire.tensor_to_proto(torch.zeros(1, 4), "float16"), "changed"),
                       (tensor_wire.tensor_to_proto(torch.zeros(4)), "2-D"),
                       (wire.common_pb2.Tensor(data=b"\0" * 8, dtype="float32", shape=[1, 4]), "bytes")):
        with pytest.raises(ValueError, match=match):
            log.add(bad)
    assert log.rows == 2


def test_drafter_prefilled_from_the_log_drafts_like_the_incremental_one(tiny_family):
    """Every committed token and the concatenated feature rows (what failover
    sends a new drafter) give the drafter the state it had."""
    verifier = verifier_builder(tiny_family)()
    drafter = drafter_builder(tiny_family, "eagle")()
    cfg = TreeParams(total_tokens=12, depth=4, expand_k=3)
    prompt = [5, 17, 42, 8, 99, 23]
    log = FeatureLog()
    first = verifier.prefill("s", prompt, SamplingParams())
    committed = prompt + [first.token]
    log.add(tensor_wire.tensor_to_proto(first.features))
    drafter.prefill("a", committed, first.features)
    for _ in range(6):
        result = verifier.verify("s", drafter.draft("a", cfg))
        drafter.commit("a", result.tokens, result.features)
        committed += result.tokens
        log.add(tensor_wire.tensor_to_proto(result.features))
    assert log.rows == len(committed) - 1
    drafter.prefill("b", committed, tensor_wire.tensor_from_proto(log.tensor()))
    a, b = drafter.draft("a", cfg), drafter.draft("b", cfg)
    assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
    assert torch.allclose(a.values, b.values, atol=1e-4)


# -- resume over gRPC --------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_resumed_prefill_over_grpc_continues_the_session_exactly(tiny_family):
    server, _ = await start_verifier(tiny_family, metrics_port=None)
    try:
        async with channel_to(server) as channel:
            stub = VerifierServiceStub(channel)
            params = wire.sampling_to_proto(SamplingParams())
            prompt = [5, 17, 42, 8, 99, 23]
            first = await stub.Prefill(verifier_pb2.VerifierPrefillRequest(
                session_id="a", prompt_ids=prompt, sampling=params, return_features=True))
            committed = prompt + [first.token]
            log = FeatureLog()
            log.add(first.features)

            async def step(sid):
                tree = tensor_wire.tree_to_proto(tree_from_lists([committed[-1] if sid == "a" else moved[-1]], [-1]))
                return await stub.Verify(verifier_pb2.VerifyRequest(session_id=sid, tree=tree,
                                                                   return_features=True))

            for _ in range(5):
                result = await step("a")
                committed += result.tokens
                log.add(result.features)
            moved = list(committed)
            resumed = await stub.Prefill(verifier_pb2.VerifierPrefillRequest(
                session_id="b", prompt_ids=moved, sampling=params, max_new_tokens=10, return_features=True,
                resume=True))
            assert resumed.token == moved[-1]                       # the pending root, nothing sampled
            assert list(resumed.features.shape) == [len(moved) - 1, log.hidden]
            assert torch.allclose(tensor_wire.tensor_from_proto(resumed.features), tensor_wire.tensor_from_proto(log.tensor()),
                                  atol=1e-4)
            for _ in range(8):
                a, b = await step("a"), await step("b")
                assert list(a.tokens) == list(b.tokens)
                committed += a.tokens
                moved += b.tokens
            err = await rpc_error(stub.Prefill(verifier_pb2.VerifierPrefillRequest(
                session_id="c", prompt_ids=prompt[:1], sampling=params, resume=True)))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "two committed tokens" in err.details()
    finally:
        await server.stop()


# -- in-process servers: a call held while its server goes away ---------------------------------------
@pytest.fixture(scope="module")
def stack(tiny_family):
    s = Stack(tiny_family)
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(stack):
    return stack.plain_output(PROMPT, N)


@pytest.fixture
def pair(stack):
    """Two verifiers, two EAGLE drafters, an orchestrator over all four; taps on
    every Verify and Draft; torn down after the test."""
    names = {"v": ["fv1", "fv2"], "d": ["fd1", "fd2"]}
    for name in names["v"]:
        stack.add_verifier(name)
    for name in names["d"]:
        stack.add_drafter(name, "eagle")
    add_orchestrator(stack, "fo", names["v"], names["d"])
    taps = {n: Tap(stack.servicer(n).engine, "verify") for n in names["v"]}
    taps.update({n: Tap(stack.servicer(n).drafter, "draft") for n in names["d"]})
    yield names, taps
    for tap in taps.values():
        tap.restore()
    for name in ["fo"] + names["v"] + names["d"]:
        if name in stack.servers:
            stack.stop(name)


def held_in(taps, names, after=0):
    """Close the taps of ``names`` (``after`` calls let through each); returns a
    function giving the one a call is held in."""
    for n in names:
        taps[n].close(after)
    return lambda: next((n for n in names if taps[n].held), None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("role", ["drafter", "verifier"])
def test_backend_stopped_mid_request_moves_the_session(stack, reference, pair, role):
    names, taps = pair
    group = names["d"] if role == "drafter" else names["v"]
    moved = sample("specdec_failovers_total", role=role)
    fallbacks = sum(sample("specdec_fallback_total", reason=r) for r in ("drafter_error", "drafters_unavailable"))
    held = held_in(taps, group, after=5)      # a few cycles first: features from several Verify calls
    with SpecdecClient(stack.address("fo"), timeout=60) as client:
        gen = Background(client, max_new_tokens=N)
        wait_for(held, what=f"a call held in a {role}")
        victim = held()
        other = next(n for n in group if n != victim)
        stack.stop(victim)                        # a call is in flight there
        for n in group:
            taps[n].open()
        stream = gen.result()
    assert stream.token_ids == reference
    assert stream.stats.completion_tokens == N and stream.stats.finish_reason == "length"
    assert sample("specdec_failovers_total", role=role) == moved + 1
    assert taps[other].sessions                   # the session went on there
    if role == "drafter":                         # ... drafting (EAGLE features and all), not plain decoding
        assert sum(sample("specdec_fallback_total", reason=r)
                   for r in ("drafter_error", "drafters_unavailable")) == fallbacks
    assert stack.wait_sessions_closed(*[n for n in names["v"] + names["d"] if n != victim]) == {
        n: 0 for n in names["v"] + names["d"] if n != victim}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("role", ["drafter", "verifier"])
def test_backend_forgetting_the_session_is_not_found_and_it_moves(stack, reference, pair, role):
    """A restarted server (or an evicted session) answers NOT_FOUND: the session
    is opened again from the committed tokens, possibly on the same server."""
    names, taps = pair
    group = names["d"] if role == "drafter" else names["v"]
    moved = sample("specdec_failovers_total", role=role)
    held = held_in(taps, group)
    with SpecdecClient(stack.address("fo"), timeout=60) as client:
        gen = Background(client, max_new_tokens=N)
        wait_for(held, what=f"a call held in a {role}")
        servicer = stack.servicer(held())
        sid = taps[held()].sessions[0]
        (servicer.drafter if role == "drafter" else servicer.engine).release(sid)
        for n in group:
            taps[n].open()
        stream = gen.result()
    assert stream.token_ids == reference
    assert sample("specdec_failovers_total", role=role) == moved + 1


class Cancelled(SpecdecError):
    code = "CANCELLED"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("role", ["drafter", "verifier"])
def test_a_backend_cancelling_a_call_is_gone_and_the_session_moves(stack, reference, pair, role):
    """A stopping server cancels the calls in flight: CANCELLED from a backend
    moves the session like UNAVAILABLE (it used to end the request)."""
    names, taps = pair
    group = names["d"] if role == "drafter" else names["v"]
    moved = sample("specdec_failovers_total", role=role)
    fallbacks = sum(sample("specdec_fallback_total", reason=r) for r in ("drafter_error", "drafters_unavailable"))
    cancelled = []
    for name in group:
        def cancel_once(sid, *args, name=name, **kw):
            if not cancelled:
                cancelled.append(name)
                raise Cancelled("server stopping (test)")
            return taps[name].original(sid, *args, **kw)
        taps[name].call = cancel_once
    with SpecdecClient(stack.address("fo"), timeout=60) as client:
        stream = client.complete(PROMPT, max_new_tokens=N)
    assert stream.token_ids == reference
    assert sample("specdec_failovers_total", role=role) == moved + 1
    other = next(n for n in group if n != cancelled[0])
    assert taps[other].sessions                   # it went on on the other server
    if role == "drafter":
        assert stream.stats.draft_tokens > 0
        assert sum(sample("specdec_fallback_total", reason=r)
                   for r in ("drafter_error", "drafters_unavailable")) == fallbacks


@pytest.mark.timeout(120)
def test_every_drafter_gone_goes_on_as_plain_decoding(stack, reference, pair):
    names, taps = pair
    held = held_in(taps, names["d"])
    before = sample("specdec_fallback_total", reason="drafters_unavailable")
    with SpecdecClient(stack.address("fo"), timeout=60) as client:
        gen = Background(client, max_new_tokens=N)
        wait_for(held, what="a call held in a drafter")
        for n in names["d"]:
            stack.stop(n)
        for n in names["d"]:
            taps[n].open()
        stream = gen.result()
        assert stream.token_ids == reference
        assert sample("specdec_fallback_total", reason="drafters_unavailable") == before + 1
        # later requests too, from the start
        again = client.complete(PROMPT, max_new_tokens=N)
    assert again.token_ids == reference and again.stats.draft_tokens == 0


@pytest.mark.timeout(120)
def test_no_verifier_left_fails_unavailable_and_what_was_streamed_stays_valid(stack, reference):
    stack.add_verifier("lone-v")
    add_orchestrator(stack, "lone", ["lone-v"])
    tap = Tap(stack.servicer("lone-v").engine, "verify")
    try:
        with SpecdecClient(stack.address("lone"), timeout=60, retries=0) as client:
            # ten cycles go through, the next is held and the verifier taken away
            tap.close(after=10)
            gen = Background(client, max_new_tokens=N)
            wait_for(lambda: tap.held, what="a held Verify")
            stack.stop("lone-v")
            tap.open()
            with pytest.raises(SpecdecUnavailable) as err:
                gen.result()
        assert "verifier" in err.value.details
        streamed = gen.stream.token_ids
        assert 0 < len(streamed) <= 11 and streamed == reference[:len(streamed)]
    finally:
        tap.restore()
        for name in ("lone", "lone-v"):
            if name in stack.servers:
                stack.stop(name)


@pytest.mark.timeout(120)
def test_failed_precondition_is_not_retried_elsewhere(stack, pair):
    names, taps = pair
    moved = sample("specdec_failovers_total", role="verifier")
    for name in names["v"]:
        def refuse(sid, tree):
            raise FailedPrecondition("tree root does not match (test)")
        taps[name].call = refuse
    with SpecdecClient(stack.address("fo"), timeout=60) as client:
        with pytest.raises(SpecdecClientError) as err:
            client.complete(PROMPT, max_new_tokens=N)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert sum(len(taps[n].sessions) for n in names["v"]) == 1          # one Verify, no second try
    assert sample("specdec_failovers_total", role="verifier") == moved


# -- real processes: specdec up, SIGKILL --------------------------------------------------------------
LONG = 200
UNFINISHED = 32   # tokens a killed session must still have to make (several cycles)


def active(addr: str, role: str) -> int:
    with grpc.insecure_channel(addr) as channel:
        if role == "drafter":
            stub, request = drafter_pb2_grpc.DrafterServiceStub(channel), drafter_pb2.DrafterGetInfoRequest()
        else:
            stub, request = VerifierServiceStub(channel), verifier_pb2.VerifierGetInfoRequest()
        try:
            return stub.GetInfo(request, timeout=2).active_sessions
        except grpc.RpcError:
            return 0


class Up:
    def __init__(self, family, tmp):
        self.state_file = tmp / "state.json"
        self.log = open(tmp / "up.err", "w+")
        cmd = [sys.executable, "-m", "specdec.cli.main", "up", "--port", "0", "--target", str(family["target"]),
               "--eagle", str(family["eagle"]), "--drafters", "2", "--verifiers", "2",
               "--state", str(self.state_file)]
        # SPECDEC_MIN_TAU 0: every cycle drafts (a paused session would not call a killed drafter)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", "SPECDEC_MIN_TAU": "0"})
        deadline = time.monotonic() + 240
        while not self.state_file.exists():
            assert self.proc.poll() is None, self.stderr()
            assert time.monotonic() < deadline, "specdec up did not get ready"
            time.sleep(0.1)
        self.state = json.loads(self.state_file.read_text())

    def stderr(self) -> str:
        # read through a file of its own: the processes write through the same open file as
        # ``self.log``, so seeking that one back would move their write offset too (and a line
        # written meanwhile would overwrite the log's start)
        return Path(self.log.name).read_text()

    def live(self, role: str) -> list[dict]:
        return [c for c in self.state[f"{role}s"] if alive(c["pid"])]

    def kill_pinned(self, role: str, gen: Background, timeout: float = 30.0) -> dict | None:
        """SIGKILL the first ``role`` process holding ``gen``'s session once it streams (a kill
        during its Prefill is a re-open, not a failover) and while it has tokens to make; None
        when it got too far first. The process is stopped before it is judged: what the client
        holds then is all the session has."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for child in self.live(role):
                if active(child["addr"], role):
                    os.kill(child["pid"], signal.SIGSTOP)
                    time.sleep(0.3)   # the tokens already made reach the client
                    made = len(gen.stream.token_ids)
                    if 0 < made <= LONG - UNFINISHED:
                        os.kill(child["pid"], signal.SIGKILL)
                        return child
                    os.kill(child["pid"], signal.SIGCONT)
                    if made:
                        return None       # else not streaming yet: look again
                    break
            time.sleep(0.005)
        raise AssertionError(f"no {role} ever held the session")

    def close(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def up(tiny_family, tmp_path_factory):
    stack = Up(tiny_family, tmp_path_factory.mktemp("up"))
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def undisturbed(up):
    with SpecdecClient(up.state["orchestrator"], timeout=120) as client:
        whole = client.complete(PROMPT, max_new_tokens=LONG)
    assert whole.stats.draft_tokens > 0 and whole.stats.completion_tokens == LONG
    return whole.token_ids


def generate_while(up, role, kill, attempts: int = 5):
    """A streamed generation during which ``kill(gen)`` runs: (tokens, stats, what
    kill returned). It starts when no ``role`` process holds a session (an earlier
    one still being released would be taken for it); a generation that ran too
    far before the kill (kill returned None) is let finish and started again."""
    for _ in range(attempts):
        wait_for(lambda: not any(active(c["addr"], role) for c in up.live(role)), timeout=60, what=f"idle {role}s")
        with SpecdecClient(up.state["orchestrator"], timeout=120, retries=0) as client:
            gen = Background(client, max_new_tokens=LONG)
            killed = kill(gen)
            stream = gen.result(timeout=120)
        assert up.proc.poll() is None, "specdec up must keep running: " + up.stderr()[-2000:]
        if killed is not None:
            return stream.token_ids, stream.stats, killed
    raise AssertionError(f"every one of {attempts} generations finished before the kill")


@pytest.mark.timeout(300)
def test_sigkilled_drafter_mid_generation_loses_nothing(up, undisturbed):
    assert len(up.live("drafter")) == 2
    tokens, stats, killed = generate_while(up, "drafter", lambda gen: up.kill_pinned("drafter", gen))
    assert tokens == undisturbed and stats.completion_tokens == LONG
    assert "drafter lost, re-prefilling another" in up.stderr()
    wait_for(lambda: f"(pid {killed['pid']}) exited with status -9" in up.stderr(), what="up reporting it")


@pytest.mark.timeout(300)
def test_sigkilled_verifier_mid_generation_loses_nothing(up, undisturbed):
    assert len(up.live("verifier")) == 2
    tokens, stats, killed = generate_while(up, "verifier", lambda gen: up.kill_pinned("verifier", gen))
    assert tokens == undisturbed and stats.completion_tokens == LONG
    assert "verifier lost, resuming the session on another" in up.stderr()
    wait_for(lambda: f"(pid {killed['pid']}) exited with status -9" in up.stderr(), what="up reporting it")


@pytest.mark.timeout(300)
def test_every_drafter_sigkilled_mid_generation_finishes_as_plain_decoding(up, undisturbed):
    def kill_all(gen):
        first = up.kill_pinned("drafter", gen)
        if first is None:
            return None
        for child in up.live("drafter"):
            os.kill(child["pid"], signal.SIGKILL)
        return first

    tokens, stats, _ = generate_while(up, "drafter", kill_all)
    assert tokens == undisturbed and stats.completion_tokens == LONG
    assert "going on with plain decoding" in up.stderr()
    assert not up.live("drafter")
    with SpecdecClient(up.state["orchestrator"], timeout=120) as client:
        after = client.complete(PROMPT, max_new_tokens=LONG)
    assert after.token_ids == undisturbed and after.stats.draft_tokens == 0


@pytest.mark.timeout(120)
def test_a_resumed_verifier_keeps_the_penalties_and_logprobs(stack, pair):
    """The session reopened on another verifier counts the prompt apart from the
    output (presence / frequency penalties see only the output) and still sends
    logprobs: the same tokens and logprobs as an undisturbed run."""
    names, taps = pair
    params = dict(max_new_tokens=N, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.2,
                  logprobs=2)
    with SpecdecClient(stack.address("fo"), timeout=60) as client:
        want = client.complete(PROMPT, **params)
        moved = sample("specdec_failovers_total", role="verifier")
        held = held_in(taps, names["v"], after=3)
        gen = Background(client, PROMPT, **params)
        wait_for(held, what="a call held in a verifier")
        servicer = stack.servicer(held())
        servicer.engine.release(taps[held()].sessions[-1])      # this request's (want's came first)
        for n in names["v"]:
            taps[n].open()
        stream = gen.result()
    assert sample("specdec_failovers_total", role="verifier") == moved + 1
    assert stream.token_ids == want.token_ids
    assert [e.token for e in stream.logprobs] == want.token_ids
    assert [e.logprob for e in stream.logprobs] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-5)
    assert [e.top_tokens for e in stream.logprobs] == [e.top_tokens for e in want.logprobs]
