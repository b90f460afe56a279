"""The servers the fuzz tests hit, and the well-formed sessions that run beside them.

One stack per test module (torn down with it, so nothing runs on behind
later tests that read the process's metrics): a verifier and an EAGLE drafter (the
tiny family, 64 session slots) and an orchestrator over both, in-process on
127.0.0.1 (``tests/running_stack.py``). While the fuzz runs, a ``Witness``
thread sends well-formed greedy requests through the orchestrator; each
must return exactly the plain greedy output computed before any fuzzing.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from running_stack import Stack
from specdec.client import SpecdecClient, SpecdecClientError
from specdec.v1 import drafter_pb2, drafter_pb2_grpc, orchestrator_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from fuzz_strategies import CONTEXT, VOCAB

WITNESS_PROMPTS = ("def add(a, b):", "for i in range(3):\n")
WITNESS_TOKENS = 24


class Witness:
    """Well-formed greedy requests in a loop on a thread of their own; every
    answer must equal the plain greedy reference."""

    def __init__(self, address: str):
        self.address = address
        with SpecdecClient(address, timeout=60) as client:
            self.references = {p: client.complete(p, max_new_tokens=WITNESS_TOKENS, method="vanilla").token_ids
                               for p in WITNESS_PROMPTS}
        self.completed = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fuzz-witness", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        i = 0
        with SpecdecClient(self.address, timeout=60) as client:
            while not self._stop.is_set():
                prompt = WITNESS_PROMPTS[i % len(WITNESS_PROMPTS)]
                i += 1
                try:
                    got = client.complete(prompt, max_new_tokens=WITNESS_TOKENS).token_ids
                except SpecdecClientError as exc:
                    self.failures.append(f"{prompt!r}: {exc}")
                    continue
                if got != self.references[prompt]:
                    self.failures.append(f"{prompt!r}: {got} != reference {self.references[prompt]}")
                self.completed += 1

    def assert_undisturbed(self, since: int, timeout_s: float = 30.0) -> None:
        """At least one more request completed since ``since``, and none went wrong."""
        deadline = time.monotonic() + timeout_s
        while self.completed <= since and not self.failures and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.failures == []
        assert self.completed > since, "no well-formed request completed during the fuzz"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(60)


class FuzzTargets:
    """Stubs of the three servers, and the facts the tests need about them."""

    def __init__(self, stack: Stack):
        self.stack = stack
        self.channels = {name: grpc.insecure_channel(stack.address(name))
                         for name in ("verifier", "drafter", "orchestrator")}
        self.verifier = verifier_pb2_grpc.VerifierServiceStub(self.channels["verifier"])
        self.drafter = drafter_pb2_grpc.DrafterServiceStub(self.channels["drafter"])
        self.orchestrator = orchestrator_pb2_grpc.OrchestratorServiceStub(self.channels["orchestrator"])
        info = self.verifier.GetInfo(verifier_pb2.VerifierGetInfoRequest(), timeout=10)
        assert (info.vocab_size, info.max_positions) == (VOCAB, CONTEXT)   # the strategies' edges
        self.hidden = info.hidden_size
        self.max_new_tokens_limit = stack.servicer("orchestrator").config.max_new_tokens_limit

    def assert_serving(self) -> None:
        self.verifier.GetInfo(verifier_pb2.VerifierGetInfoRequest(), timeout=10)
        self.drafter.GetInfo(drafter_pb2.DrafterGetInfoRequest(), timeout=10)

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()


@pytest.fixture(scope="module")
def fuzz_stack(tiny_family):
    stack = Stack(tiny_family)
    stack.add_verifier("verifier", max_sessions=64)
    stack.add_drafter("drafter", kind="eagle", max_sessions=64)
    stack.add_orchestrator("orchestrator", verifier="verifier", drafter="drafter")
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def targets(fuzz_stack):
    t = FuzzTargets(fuzz_stack)
    yield t
    t.close()


@pytest.fixture(scope="module")
def witness(fuzz_stack):
    w = Witness(fuzz_stack.address("orchestrator"))
    yield w
    w.close()
