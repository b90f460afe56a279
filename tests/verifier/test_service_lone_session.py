"""The verifier service with batching on: a lone session's steps skip the
batch scheduler, concurrent sessions' steps go through it, and both give
the tokens plain greedy decoding gives."""

import asyncio

import pytest

from specdec.local import DrafterChoice, build_local, generate
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams
from specdec.v1 import common_pb2, verifier_pb2
from verifier.service import VerifierService, VerifierServiceConfig

PROMPTS = [[5, 6, 7], [20, 21, 22, 20, 21, 22, 23]]
NEW = 12


@pytest.fixture(scope="module")
def stack(tiny_family):
    return build_local(ModelSpec(str(tiny_family["target"])), DrafterChoice("eagle", str(tiny_family["eagle"])))


def greedy(stack, prompt):
    return generate(stack.verifier, None, prompt, SamplingParams(), StopCriteria(max_new_tokens=NEW), None).tokens


async def decode(service, sid: str, prompt: list[int]) -> list[int]:
    """Greedy decoding through the service's Prefill and one-token Verify calls."""
    first = await service.Prefill(verifier_pb2.VerifierPrefillRequest(session_id=sid, prompt_ids=prompt,
                                                                      max_new_tokens=NEW), None)
    out = [first.token]
    while len(out) < NEW:
        tree = common_pb2.DraftTree(tokens=[out[-1]], parents=[-1])
        answer = await service.Verify(verifier_pb2.VerifyRequest(session_id=sid, tree=tree), None)
        out.extend(answer.tokens)
    await service.Release(verifier_pb2.VerifierReleaseRequest(session_id=sid), None)
    return out[:NEW]


def test_lone_and_concurrent_sessions_match_greedy(stack):
    want = [greedy(stack, p) for p in PROMPTS]

    async def main():
        service = VerifierService(VerifierServiceConfig(batch_window_ms=20))
        await service.load(lambda: stack.verifier)
        service.lifecycle.ready = True      # what the running server does once loaded
        try:
            lone = await decode(service, "lone", PROMPTS[0])
            lone_batches = service.scheduler.batches
            together = await asyncio.gather(*(decode(service, f"both-{i}", p) for i, p in enumerate(PROMPTS)))
            return lone, lone_batches, together, service.scheduler.batches
        finally:
            running = service.scheduler._task is not None
            await service.aclose()          # what the server does when it stops
            assert running and service.scheduler._task is None, "the batching task outlived the service"

    lone, lone_batches, together, batches = asyncio.run(main())
    assert lone == want[0]
    assert together == want
    assert lone_batches == 0                # a lone session never waits on the scheduler
    assert batches > 0                      # concurrent sessions' verifies went through it
