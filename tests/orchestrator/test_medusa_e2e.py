"""Medusa heads through the three services: the drafter service hosts the
heads and gets the target's features through the orchestrator; greedy
output is token-identical to in-process vanilla for the dynamic and the
static tree, chosen per request, with concurrent sessions batched on the
drafter (one heads forward for all of them)."""

import json
import urllib.error

import pytest

from running_stack import Stack, complete_concurrently
from specdec.client import SpecdecClient
from tiny import tiny_medusa

PROMPTS = ["def add(a, b):", "for i in range(3):\n", "class Point:", "import os\n"]
N = 24


@pytest.fixture(scope="module")
def stack(tiny_family, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from drafter.medusa_heads import save_heads

    target = AutoModelForCausalLM.from_pretrained(tiny_family["target"])
    paths = {**tiny_family, "medusa": tmp_path_factory.mktemp("medusa-e2e") / "heads"}
    save_heads(tiny_medusa(target, seed=4, num_heads=3), paths["medusa"], "vllm")
    s = Stack(paths)
    s.add_verifier("verifier")
    s.add_orchestrator("none")
    s.add_drafter("drafter-medusa", "medusa", batch_window_ms=20.0)
    s.add_orchestrator("medusa", drafter="drafter-medusa")
    yield s
    s.close()


def test_greedy_matches_vanilla_through_the_services(stack):
    with SpecdecClient(stack.address("none")) as plain:
        want = [plain.complete(p, max_new_tokens=N).token_ids for p in PROMPTS]
    with stack.prepared_batches("drafter-medusa") as batches, SpecdecClient(stack.address("medusa")) as client:
        for method in ("eagle2", "static"):
            got = complete_concurrently(client, PROMPTS, N, method)
            assert [c.token_ids for c in got] == want, method
            assert sum(c.stats.draft_tokens for c in got) > 0
    assert batches and max(batches) > 1          # concurrent sessions shared a heads forward
    assert stack.wait_sessions_closed("drafter-medusa") == {"drafter-medusa": 0}


def test_the_openai_api_takes_the_method_per_request(stack):
    with stack.openai("medusa") as post:
        common = dict(prompt=PROMPTS[0], max_tokens=N, temperature=0, return_token_ids=True)
        plain = post(**common, method="vanilla")
        for method in ("eagle2", "static"):
            got = post(**common, method=method)
            assert got["token_ids"] == plain["token_ids"] and got["specdec"]["draft_tokens"] > 0
        assert plain["specdec"]["draft_tokens"] == 0
        with pytest.raises(urllib.error.HTTPError) as err:
            post(**common, method="typical")
        body = json.loads(err.value.read())["error"]
        assert err.value.code == 400 and body["param"] == "method" and "must be one of" in body["message"]
