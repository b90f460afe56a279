"""The soak's request mix, and what each request's outcome is judged to be.

Each client loops until the load ends, drawing one request kind at a time
(``KIND_WEIGHTS``) from its own seeded generator:

- ``greedy`` / ``greedy-stream``: a whole greedy completion (Complete, or a
  Generate stream read to its end): its tokens must equal the prompt's
  reference, the same prompt decoded greedily before the load;
- ``sampled``: a seeded completion at temperature 0.8 (its status is judged);
- ``cancel``: a greedy stream cancelled before its first chunk or after a
  few: the tokens it delivered must be a prefix of the reference;
- ``deadline``: a greedy Complete under a client deadline drawn log-uniformly
  from 1 ms to 2 s (DEADLINE_EXCEEDED or a whole, correct answer);
- ``malformed``: one of ``MALFORMED``, which must be INVALID_ARGUMENT.

``judge`` sorts an outcome into ok / cancelled / deadline / expected (a
documented status for what was done: INVALID_ARGUMENT for a malformed
request, UNAVAILABLE while a killed process was away) / unexpected.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field

import grpc

from specdec.client.sdk import build_request
from specdec.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

PROMPTS = (
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\nimport sys\n\n",
    "for i in range(10):\n",
    "def read_lines(path):\n    \"\"\"Return the lines of a file.\"\"\"\n",
    # a long prompt: its prefill is the window in which a request can end
    "# utilities\n" + "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(10)),
)
KIND_WEIGHTS = {"greedy": 3, "greedy-stream": 2, "sampled": 2, "cancel": 2, "deadline": 2, "malformed": 1}
REQUEST_TIMEOUT_S = 120.0              # well-formed requests: hitting it is a failure, not a deadline case
MIN_DEADLINE_S, MAX_DEADLINE_S = 0.001, 2.0
RETRY_PAUSE_S = 0.2                    # after UNAVAILABLE: a client does not spin on a process that is away
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000), ("grpc.max_send_message_length", 8 << 20)]


def _malformed(**fields) -> orchestrator_pb2.GenerateRequest:
    sampling = fields.pop("sampling", {})
    tree = fields.pop("tree", {})
    request = orchestrator_pb2.GenerateRequest(prompt=fields.pop("prompt", PROMPTS[0]), max_new_tokens=8,
                                               sampling=common_pb2.SamplingParams(**sampling),
                                               tree=common_pb2.TreeParams(**tree))
    for name, value in fields.items():
        setattr(request, name, value)
    return request


# Each must be answered INVALID_ARGUMENT (the bounds of orchestrator_pb2 fields).
MALFORMED = {
    "empty prompt": _malformed(prompt=""),
    "negative max_new_tokens": _malformed(max_new_tokens=-1),
    "max_new_tokens over the limit": _malformed(max_new_tokens=10**7),
    "prompt longer than the context": _malformed(prompt="x = 1\n" * 20_000),
    "NaN temperature": _malformed(sampling={"temperature": math.nan}),
    "negative temperature": _malformed(sampling={"temperature": -1.0}),
    "infinite temperature": _malformed(sampling={"temperature": math.inf}),
    "top_p above 1": _malformed(sampling={"temperature": 1.0, "top_p": 1.5}),
    "negative top_k": _malformed(sampling={"temperature": 1.0, "top_k": -3}),
    "unknown tree method": _malformed(tree={"method": 99}),
    "unknown proposals": _malformed(tree={"proposals": 9}),
    "negative total_tokens": _malformed(tree={"total_tokens": -1}),
    "negative depth": _malformed(tree={"depth": -2}),
    "negative expand_k": _malformed(tree={"expand_k": -5}),
    "NaN value_temperature": _malformed(tree={"value_temperature": math.nan}),
    "negative value_temperature": _malformed(tree={"value_temperature": -0.5}),
    "1 MB request_id": _malformed(request_id="r" * (1 << 20)),
}


@dataclass
class Outcome:
    """One request: what was sent, how it ended, what it returned."""

    client: int
    kind: str
    case: str                      # the prompt's index, or the malformed case's name
    code: str                      # "OK" or the status code's name
    detail: str
    start: float                   # time.monotonic()
    end: float
    tokens: list[int] = field(default_factory=list)
    verdict: str = ""              # set by judge()
    mismatch: bool = False         # greedy tokens that are not (a prefix of) the reference
    during: str = ""               # the processes away while it ran (set by judge())

    @property
    def latency_s(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Window:
    """A process away: from its kill until it was ready again (plus a grace period)."""

    role: str
    name: str
    start: float
    end: float


def judge(outcome: Outcome, windows: list[Window], references: dict[int, list[int]]) -> Outcome:
    """Set ``verdict`` and ``mismatch`` (see the module docstring)."""
    overlapping = [w.name for w in windows if outcome.start <= w.end and outcome.end >= w.start]
    outcome.during = ", ".join(overlapping)
    away = bool(overlapping)
    code = outcome.code
    if outcome.kind == "malformed":
        outcome.verdict = ("expected" if code == "INVALID_ARGUMENT" or (away and code == "UNAVAILABLE")
                           else "unexpected")
        return outcome
    if code == "OK":
        outcome.verdict = "ok"
    elif code == "CANCELLED" and outcome.kind == "cancel":
        outcome.verdict = "cancelled"
    elif code == "DEADLINE_EXCEEDED" and outcome.kind == "deadline":
        outcome.verdict = "deadline"
    elif code == "UNAVAILABLE" and away:
        outcome.verdict = "expected"
    else:
        outcome.verdict = "unexpected"
    if outcome.kind != "sampled" and outcome.tokens:
        reference = references[int(outcome.case)]
        whole = outcome.kind != "cancel" and code == "OK"
        got = outcome.tokens
        outcome.mismatch = got != reference if whole else got != reference[:len(got)]
    return outcome


class Client:
    """One soak client: its own channel, generator and list of outcomes."""

    def __init__(self, index: int, address: str, seed: int, max_new_tokens: int):
        self.index = index
        self.address = address
        self.rng = random.Random(seed * 7919 + index)
        self.max_new_tokens = max_new_tokens
        self.outcomes: list[Outcome] = []

    async def run(self, until: float) -> list[Outcome]:
        kinds, weights = zip(*KIND_WEIGHTS.items())
        async with grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
            while time.monotonic() < until:
                kind = self.rng.choices(kinds, weights)[0]
                outcome = await self.one(stub, kind)
                self.outcomes.append(outcome)
                if outcome.code == "UNAVAILABLE":
                    await asyncio.sleep(RETRY_PAUSE_S)
        return self.outcomes

    async def one(self, stub, kind: str) -> Outcome:
        prompt = self.rng.randrange(len(PROMPTS))
        greedy = build_request(PROMPTS[prompt], max_new_tokens=self.max_new_tokens,
                               request_id=f"soak-{self.index}-{len(self.outcomes)}")
        if kind == "malformed":
            case = self.rng.choice(sorted(MALFORMED))
            return await self._complete(stub, kind, case, MALFORMED[case], REQUEST_TIMEOUT_S)
        if kind == "sampled":
            request = build_request(PROMPTS[prompt], max_new_tokens=self.max_new_tokens, temperature=0.8,
                                    top_p=0.95, seed=self.rng.randrange(1 << 31))
            return await self._complete(stub, kind, str(prompt), request, REQUEST_TIMEOUT_S)
        if kind == "deadline":
            timeout = math.exp(self.rng.uniform(math.log(MIN_DEADLINE_S), math.log(MAX_DEADLINE_S)))
            return await self._complete(stub, kind, str(prompt), greedy, timeout)
        if kind == "greedy":
            return await self._complete(stub, kind, str(prompt), greedy, REQUEST_TIMEOUT_S)
        # a stream: read to the end, or cancelled after `after` chunks (0: after a short wait)
        after = None if kind == "greedy-stream" else self.rng.randrange(0, 6)
        return await self._stream(stub, kind, str(prompt), greedy, after)

    async def _complete(self, stub, kind: str, case: str, request, timeout: float) -> Outcome:
        start = time.monotonic()
        try:
            response = await stub.Complete(orchestrator_pb2.CompleteRequest(request=request), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            return Outcome(self.index, kind, case, exc.code().name, exc.details() or "", start, time.monotonic())
        return Outcome(self.index, kind, case, "OK", "", start, time.monotonic(), list(response.token_ids))

    async def _stream(self, stub, kind: str, case: str, request, after: int | None) -> Outcome:
        start = time.monotonic()
        tokens: list[int] = []
        call = stub.Generate(request, timeout=REQUEST_TIMEOUT_S)
        try:
            if after == 0:
                await asyncio.sleep(self.rng.uniform(0.0, 0.05))
                call.cancel()
            else:
                chunks = 0
                async for message in call:
                    if message.HasField("chunk"):
                        tokens.extend(message.chunk.token_ids)
                        chunks += 1
                    if after is not None and chunks >= after:
                        call.cancel()
                        break
        except grpc.aio.AioRpcError:
            pass
        except asyncio.CancelledError:
            if not call.cancelled():
                raise
        code = await call.code()
        details = await call.details()
        return Outcome(self.index, kind, case, code.name, details or "", start, time.monotonic(), tokens)
