"""Nothing left behind: however a request ends, every backend reports zero open
sessions (GetInfo ``active_sessions``) within a few seconds (issue 18).

Real servers on 127.0.0.1 (a verifier and an EAGLE drafter in-process, a
fresh pair per test so a leak cannot spill into the next test; the
orchestrator in-process, or as a process of its own where it is killed).
Windows are made wide and certain by slowing one engine call (a sleep before
the verifier's or the drafter's Prefill / Verify on its worker thread): a
request ends while that call is in flight.

- client deadlines from 1 ms up on Complete and Generate, ending during the
  verifier's Prefill; from 150 ms up, ending during the drafter's Prefill
  and during the cycles;
- a Generate stream cancelled before its first token (verifier Prefill in
  flight), during the drafter's Prefill, mid-way and near the end;
- the orchestrator killed with SIGKILL mid-request.

A verifier Prefill in flight when its request ends is released when it
lands (the orchestrator releases every backend it sent a Prefill to, and the
backend releases a session whose Prefill RPC ended before it was opened); a
dead orchestrator's sessions go when their lease lapses (docs/serving.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from running_stack import Stack
from specdec.client.sdk import build_request
from specdec.v1 import drafter_pb2, drafter_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc, verifier_pb2
from specdec.v1 import verifier_pb2_grpc

PROMPT = "class Point:"
SLOW_S = 0.4                      # a slowed engine call takes this long
CLOSED_WITHIN_S = 5.0             # "within a few seconds"
DEADLINES_S = (0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.3, 0.6, 1.0, 2.0)
# Deadlines that end after the verifier's Prefill (a few ms on the tiny model),
# so that each later stage is met by many requests.
LATER_DEADLINES_S = (0.15, 0.3, 0.6, 1.0, 2.0)


@pytest.fixture
def stack(tiny_family):
    s = Stack(tiny_family)
    s.add_verifier("verifier")
    s.add_drafter("drafter", kind="eagle")
    s.add_orchestrator("orchestrator", verifier="verifier", drafter="drafter")
    yield s
    s.close()


def slow_down(monkeypatch, engine, method: str, seconds: float = SLOW_S) -> None:
    """``engine.method`` sleeps ``seconds`` (on the servicer's worker thread) before running."""
    original = getattr(engine, method)

    def slowed(*args, **kwargs):
        time.sleep(seconds)
        return original(*args, **kwargs)

    monkeypatch.setattr(engine, method, slowed)


def reported_sessions(stack: Stack) -> dict[str, int]:
    """Open sessions as each backend's GetInfo reports them."""
    counts = {}
    for name, stub_type, request in (("verifier", verifier_pb2_grpc.VerifierServiceStub,
                                      verifier_pb2.VerifierGetInfoRequest()),
                                     ("drafter", drafter_pb2_grpc.DrafterServiceStub,
                                      drafter_pb2.DrafterGetInfoRequest())):
        with grpc.insecure_channel(stack.address(name)) as channel:
            counts[name] = stub_type(channel).GetInfo(request, timeout=5).active_sessions
    return counts


def assert_all_closed(stack: Stack, within_s: float = CLOSED_WITHIN_S) -> None:
    deadline = time.monotonic() + within_s
    counts = reported_sessions(stack)
    while any(counts.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
        counts = reported_sessions(stack)
    assert counts == {"verifier": 0, "drafter": 0}, f"sessions still open {within_s:g} s after the requests ended"


def call_with_deadline(address: str, rpc: str, timeout: float, max_new_tokens: int = 200) -> str:
    """One request under a client deadline -> its status code's name."""
    request = build_request(PROMPT, max_new_tokens=max_new_tokens)
    with grpc.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        try:
            if rpc == "Complete":
                stub.Complete(orchestrator_pb2.CompleteRequest(request=request), timeout=timeout)
            else:
                for _ in stub.Generate(request, timeout=timeout):
                    pass
        except grpc.RpcError as exc:
            return exc.code().name
    return "OK"


def deadline_sweep(stack: Stack, rpc: str, deadlines=DEADLINES_S) -> list[str]:
    codes = [call_with_deadline(stack.address("orchestrator"), rpc, t) for t in deadlines]
    assert set(codes) <= {"OK", "DEADLINE_EXCEEDED"}, codes
    assert "DEADLINE_EXCEEDED" in codes
    return codes


# -- client deadlines ------------------------------------------------------------------------
@pytest.mark.parametrize("rpc", ["Complete", "Generate"])
def test_deadline_during_the_verifier_prefill_leaks_nothing(stack, monkeypatch, rpc):
    slow_down(monkeypatch, stack.servicer("verifier").engine, "prefill")
    deadline_sweep(stack, rpc)
    assert_all_closed(stack)


@pytest.mark.parametrize("rpc", ["Complete", "Generate"])
def test_deadline_during_the_drafter_prefill_leaks_nothing(stack, monkeypatch, rpc):
    slow_down(monkeypatch, stack.servicer("drafter").drafter, "prefill", 2.5)
    deadline_sweep(stack, rpc, LATER_DEADLINES_S)
    assert_all_closed(stack)


@pytest.mark.parametrize("rpc", ["Complete", "Generate"])
def test_deadline_during_the_cycles_leaks_nothing(stack, monkeypatch, rpc):
    slow_down(monkeypatch, stack.servicer("verifier").engine, "verify", 0.05)
    deadline_sweep(stack, rpc, LATER_DEADLINES_S)
    assert_all_closed(stack)


# -- cancels -----------------------------------------------------------------------------------
def cancel_stream(address: str, after_tokens: int, wait_s: float = 0.0,
                  max_new_tokens: int = 120) -> tuple[list[int], grpc.StatusCode]:
    """A Generate stream cancelled once it delivered ``after_tokens`` tokens (0:
    ``wait_s`` after sending) -> (the tokens it delivered, its status)."""
    tokens: list[int] = []
    with grpc.insecure_channel(address) as channel:
        call = orchestrator_pb2_grpc.OrchestratorServiceStub(channel).Generate(
            build_request(PROMPT, max_new_tokens=max_new_tokens), timeout=60)
        if after_tokens == 0:
            time.sleep(wait_s)
        else:
            for message in call:
                tokens += message.chunk.token_ids
                if len(tokens) >= after_tokens:
                    break
        call.cancel()
        return tokens, call.code()


def test_cancel_before_the_first_token_leaks_nothing(stack, monkeypatch):
    slow_down(monkeypatch, stack.servicer("verifier").engine, "prefill")
    for wait_s in (0.05, 0.15, 0.3):               # each while the slowed Prefill runs
        assert cancel_stream(stack.address("orchestrator"), 0, wait_s) == ([], grpc.StatusCode.CANCELLED)
    assert_all_closed(stack)


@pytest.mark.parametrize("stage,after_tokens,slowed", [
    ("during the drafter prefill", 1, ("drafter", "prefill")),
    ("mid-way", 60, ("verifier", "verify")),
    ("near the end", 110, None),
])
def test_cancel_leaks_nothing(stack, monkeypatch, stage, after_tokens, slowed):
    if slowed == ("drafter", "prefill"):
        slow_down(monkeypatch, stack.servicer("drafter").drafter, "prefill")
    elif slowed == ("verifier", "verify"):
        slow_down(monkeypatch, stack.servicer("verifier").engine, "verify", 0.02)
    for _ in range(3):
        tokens, code = cancel_stream(stack.address("orchestrator"), after_tokens)
        assert len(tokens) >= after_tokens
        # near the end, the last chunk may complete the stream before the cancel
        assert code == grpc.StatusCode.CANCELLED or (code == grpc.StatusCode.OK and len(tokens) == 120)
    assert_all_closed(stack)


# -- the orchestrator killed ---------------------------------------------------------------------
def start_orchestrator_process(stack: Stack, tokenizer_dir, ready_file) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli.stack", "orchestrator", "serve", "--verifier", stack.address("verifier"),
         "--drafter", stack.address("drafter"), "--tokenizer", str(tokenizer_dir), "--host", "127.0.0.1",
         "--port", "0", "--metrics-port", "off", "--log-level", "WARNING", "--ready-file", str(ready_file)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while not ready_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the orchestrator did not start"
        time.sleep(0.05)
    return proc, f"127.0.0.1:{json.loads(ready_file.read_text())['port']}"


def test_orchestrator_killed_mid_request_leaks_nothing(stack, monkeypatch, tiny_family, tmp_path):
    slow_down(monkeypatch, stack.servicer("verifier").engine, "verify", 0.05)
    proc, address = start_orchestrator_process(stack, tiny_family["target"], tmp_path / "ready")
    try:
        with grpc.insecure_channel(address) as channel:
            call = orchestrator_pb2_grpc.OrchestratorServiceStub(channel).Generate(
                build_request(PROMPT, max_new_tokens=300), timeout=60)
            next(call)
            assert stack.wait_sessions("verifier", "drafter", count=1) == {"verifier": 1, "drafter": 1}
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            with pytest.raises(grpc.RpcError) as err:
                for _ in call:
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_all_closed(stack)
