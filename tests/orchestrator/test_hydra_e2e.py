"""Hydra heads through the three services: the drafter service hosts the
heads (and the target's embedding table) and gets the target's features
through the orchestrator; greedy output is token-identical to in-process
vanilla for the dynamic and the static tree, chosen per request, through
gRPC and the OpenAI API. Hydra++ (prefix-mlp) heads behind a drafter with a
batch window do the same, concurrent sessions sharing their first level
(``HydraDrafter.prepare``), the prefix layer's KV cache following each
session's commits."""

import pytest

from running_stack import Stack, complete_concurrently
from serving.helpers import start_drafter
from specdec.client import SpecdecClient
from tiny import tiny_hydra

PROMPTS = ["def add(a, b):", "for i in range(3):\n", "class Point:"]
N = 24


@pytest.fixture(scope="module")
def stack(tiny_family, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from drafter.hydra_heads import save_heads

    target = AutoModelForCausalLM.from_pretrained(tiny_family["target"])
    paths = {**tiny_family, "hydra": tmp_path_factory.mktemp("hydra-e2e") / "heads"}
    save_heads(tiny_hydra(target, seed=4, num_heads=3), paths["hydra"])
    prefix = paths["hydra"].parent / "prefix-mlp"
    save_heads(tiny_hydra(target, seed=4, num_heads=3, prefix=True), prefix)
    s = Stack(paths)
    s.add_verifier("verifier")
    s.add_orchestrator("none")
    s.add_drafter("drafter-hydra", "hydra")
    s.add_orchestrator("hydra", drafter="drafter-hydra")
    s.servers["drafter-hydra++"] = s.loop.run(start_drafter({**paths, "hydra": prefix}, "hydra", metrics_port=None,
                                                            batch_window_ms=20.0))
    s.add_orchestrator("hydra++", drafter="drafter-hydra++")
    yield s
    s.close()


def test_greedy_matches_vanilla_through_the_services(stack):
    with SpecdecClient(stack.address("none")) as plain:
        want = [plain.complete(p, max_new_tokens=N).token_ids for p in PROMPTS]
    with SpecdecClient(stack.address("hydra")) as client:
        for method in ("eagle2", "static"):
            got = complete_concurrently(client, PROMPTS, N, method)
            assert [c.token_ids for c in got] == want, method
            assert sum(c.stats.draft_tokens for c in got) > 0
    assert stack.wait_sessions_closed("drafter-hydra") == {"drafter-hydra": 0}


def test_prefix_mlp_heads_batched_match_vanilla_through_the_services(stack):
    with SpecdecClient(stack.address("none")) as plain:
        want = [plain.complete(p, max_new_tokens=N).token_ids for p in PROMPTS]
    assert stack.servicer("drafter-hydra++").drafter.heads.arch == "prefix-mlp"
    with stack.prepared_batches("drafter-hydra++") as batches, SpecdecClient(stack.address("hydra++")) as client:
        for method in ("eagle2", "static"):
            got = complete_concurrently(client, PROMPTS, N, method)
            assert [c.token_ids for c in got] == want, method
            assert sum(c.stats.draft_tokens for c in got) > 0
    assert batches and max(batches) > 1          # concurrent sessions shared their first level
    assert stack.wait_sessions_closed("drafter-hydra++") == {"drafter-hydra++": 0}


def test_the_openai_api_takes_the_method_per_request(stack):
    with stack.openai("hydra") as post:
        common = dict(prompt=PROMPTS[0], max_tokens=N, temperature=0, return_token_ids=True)
        plain = post(**common, method="vanilla")
        for method in ("eagle2", "static"):
            got = post(**common, method=method)
            assert got["token_ids"] == plain["token_ids"] and got["specdec"]["draft_tokens"] > 0
        assert plain["specdec"]["draft_tokens"] == 0
