"""Medusa and Hydra drafters (Hydra++ prefix-mlp heads too: their prefix
layer's KV cache rebuilt from the whole feature log) fail over as the EAGLE
ones do (``tests/orchestrator/test_failover.py``): a drafter stopped while a Draft
call is held in it moves the session to the other drafter of its kind, which
is prefilled from the verifier's feature log and goes on drafting (no
fallback to plain decoding); the greedy output is unchanged."""

import pytest

from running_stack import Stack, Tap
from specdec.client import SpecdecClient
from test_failover import N, PROMPT, held_in, sample
from test_routing import Background, add_orchestrator, wait_for
from tiny import save_tiny_heads

FALLBACKS = ("drafter_error", "drafters_unavailable")


@pytest.fixture(scope="module")
def stack(tiny_family, tmp_path_factory):
    heads = save_tiny_heads(tiny_family["target"], tmp_path_factory.mktemp("heads-failover"), "vllm")
    s = Stack({**tiny_family, **heads})
    s.add_verifier("verifier")
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(stack):
    return stack.plain_output(PROMPT, N)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["medusa", "hydra", "hydra-prefix"])
def test_a_drafter_stopped_mid_request_moves_the_session_and_drafting_goes_on(stack, reference, kind):
    names, orchestrator = [f"{kind}-1", f"{kind}-2"], f"orchestrator-{kind}"
    for name in names:
        stack.add_drafter(name, kind)
    add_orchestrator(stack, orchestrator, ["verifier"], names)
    taps = {n: Tap(stack.servicer(n).drafter, "draft") for n in names}
    try:
        moved = sample("specdec_failovers_total", role="drafter")
        fallbacks = sum(sample("specdec_fallback_total", reason=r) for r in FALLBACKS)
        held = held_in(taps, names, after=3)          # a few cycles first: features from several verifies
        with SpecdecClient(stack.address(orchestrator), timeout=60) as client:
            gen = Background(client, PROMPT, max_new_tokens=N)
            wait_for(held, what=f"a Draft held in a {kind} drafter")
            victim = held()
            other = next(n for n in names if n != victim)
            stack.stop(victim)                        # a call is in flight there
            for n in names:
                taps[n].open()
            stream = gen.result()
        assert stream.token_ids == reference
        assert stream.stats.completion_tokens == N
        assert sample("specdec_failovers_total", role="drafter") == moved + 1
        assert taps[other].sessions                   # the session went on drafting there
        assert sum(sample("specdec_fallback_total", reason=r) for r in FALLBACKS) == fallbacks
        assert stack.wait_sessions_closed(other, "verifier") == {other: 0, "verifier": 0}
    finally:
        for tap in taps.values():
            tap.restore()
        for name in [orchestrator] + names:
            if name in stack.servers:
                stack.stop(name)
