"""Lookahead decoding through the services: no drafter service; the
orchestrator asks the verifier to draft each tree itself
(``VerifyRequest.lookahead_depth``) and the verifier keeps each session's
pool and window. Greedy output is token-identical to vanilla, per request
(gRPC and the OpenAI API), with concurrent sessions on a verifier that
batches the other sessions' verifies, and when the verifier is lost
mid-request (the session resumes on another, its pool rebuilt from the
committed tokens); the pools go with the sessions."""

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from running_stack import Stack, Tap
from test_routing import Background, add_orchestrator, sample, wait_for
from specdec.client import SpecdecClient
from specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

PROMPTS = ["def add(a, b):", "for i in range(3):\n", "class Point:", "import os\n"]
N = 24


@pytest.fixture(scope="module")
def stack(tiny_family):
    s = Stack(tiny_family)
    s.add_verifier("verifier", batch_window_ms=20.0)
    s.add_orchestrator("none")
    yield s
    s.close()


def test_greedy_matches_vanilla_through_the_services(stack):
    drafts = sample("specdec_drafts_total")
    with SpecdecClient(stack.address("none")) as client:
        want = [client.complete(p, max_new_tokens=N, method="vanilla").token_ids for p in PROMPTS]
        with ThreadPoolExecutor(2 * len(PROMPTS)) as pool:      # beside vanilla sessions, batched
            looked = [pool.submit(client.complete, p, max_new_tokens=N, method="lookahead") for p in PROMPTS]
            plain = [pool.submit(client.complete, p, max_new_tokens=N, method="vanilla") for p in PROMPTS]
            got, again = [f.result() for f in looked], [f.result().token_ids for f in plain]
    assert [c.token_ids for c in got] == want and again == want
    assert sum(c.stats.draft_tokens for c in got) > 0 and sum(c.stats.accepted_tokens for c in got) > 0
    # the lookahead cycles count as drafts, vanilla's do not (a request's last cycle, one token left, is plain)
    cycles = sum(c.stats.cycles for c in got)
    assert cycles - len(PROMPTS) <= sample("specdec_drafts_total") - drafts <= cycles
    engine = stack.servicer("verifier").engine
    assert stack.wait_sessions_closed("verifier") == {"verifier": 0} and len(engine.sessions) == 0


def test_a_verify_request_says_lookahead(stack):
    """The wire: lookahead_depth > 0 makes the verifier draft; a negative one is refused naming the field."""
    with grpc.insecure_channel(stack.address("verifier")) as channel:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        first = stub.Prefill(verifier_pb2.VerifierPrefillRequest(session_id="s", prompt_ids=[5, 6, 7, 5, 6, 7, 5, 6],
                                                                  sampling=common_pb2.SamplingParams()))
        root = common_pb2.DraftTree(tokens=[first.token], parents=[-1])
        step = stub.Verify(verifier_pb2.VerifyRequest(session_id="s", tree=root, lookahead_depth=2))
        assert step.verified_nodes >= 1 and len(step.tokens) == len(step.accepted_nodes) + 1
        with pytest.raises(grpc.RpcError) as err:
            stub.Verify(verifier_pb2.VerifyRequest(session_id="s", lookahead_depth=-1))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lookahead_depth" in err.value.details()
        stub.Release(verifier_pb2.VerifierReleaseRequest(session_id="s"))


def test_the_openai_api_takes_method_lookahead(stack):
    with stack.openai("none") as post:
        common = dict(prompt=PROMPTS[1], max_tokens=N, temperature=0, return_token_ids=True)
        plain = post(**common, method="vanilla")
        got = post(**common, method="lookahead")
        assert got["token_ids"] == plain["token_ids"] and got["specdec"]["draft_tokens"] > 0
        assert plain["specdec"]["draft_tokens"] == 0


@pytest.mark.timeout(120)
def test_a_lost_verifier_moves_the_session_and_nothing_changes(stack):
    with SpecdecClient(stack.address("none")) as client:
        want = client.complete(PROMPTS[2], max_new_tokens=40, method="vanilla").token_ids
    names = ["lv1", "lv2"]
    for name in names:
        stack.add_verifier(name)
    add_orchestrator(stack, "lo", names)
    taps = {n: Tap(stack.servicer(n).engine, "verify_lookahead") for n in names}
    moved = sample("specdec_failovers_total", role="verifier")
    try:
        for tap in taps.values():
            tap.close(after=3)                    # a few lookahead cycles first
        with SpecdecClient(stack.address("lo"), timeout=60) as client:
            gen = Background(client, PROMPTS[2], max_new_tokens=40, method="lookahead")
            wait_for(lambda: any(t.held for t in taps.values()), what="a lookahead verify held")
            victim = next(n for n in names if taps[n].held)
            stack.stop(victim)
            for tap in taps.values():
                tap.open()
            stream = gen.result()
        assert stream.token_ids == want
        assert sample("specdec_failovers_total", role="verifier") == moved + 1
        assert taps[next(n for n in names if n != victim)].sessions     # lookahead cycles went on there
    finally:
        for tap in taps.values():
            tap.restore()
        for name in ["lo", *names]:
            if name in stack.servers:
                stack.stop(name)
