"""Hydra heads through the three services: the drafter service hosts the
heads (and the target's embedding table) and gets the target's features
through the orchestrator; greedy output is token-identical to in-process
vanilla for the dynamic and the static tree, chosen per request, through
gRPC and the OpenAI API. Hydra++ (prefix-mlp) heads behind a drafter with a
batch window do the same, concurrent sessions sharing their first level
(``HydraDrafter.prepare``), the prefix layer's KV cache following each
session's commits."""

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from running_stack import Stack
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
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                got = list(pool.map(lambda p: client.complete(p, max_new_tokens=N, method=method), PROMPTS))
            assert [c.token_ids for c in got] == want, method
            assert sum(c.stats.draft_tokens for c in got) > 0
    assert stack.wait_sessions_closed("drafter-hydra") == {"drafter-hydra": 0}


def test_prefix_mlp_heads_batched_match_vanilla_through_the_services(stack):
    with SpecdecClient(stack.address("none")) as plain:
        want = [plain.complete(p, max_new_tokens=N).token_ids for p in PROMPTS]
    drafter = stack.servicer("drafter-hydra++").drafter
    assert drafter.heads.arch == "prefix-mlp"
    calls = []
    prepare = drafter.prepare
    drafter.prepare = lambda sids: (calls.append(len(sids)), prepare(sids))[1]
    try:
        with SpecdecClient(stack.address("hydra++")) as client:
            for method in ("eagle2", "static"):
                with ThreadPoolExecutor(len(PROMPTS)) as pool:
                    got = list(pool.map(lambda p: client.complete(p, max_new_tokens=N, method=method), PROMPTS))
                assert [c.token_ids for c in got] == want, method
                assert sum(c.stats.draft_tokens for c in got) > 0
    finally:
        drafter.prepare = prepare
    assert calls and max(calls) > 1          # concurrent sessions shared their first level
    assert stack.wait_sessions_closed("drafter-hydra++") == {"drafter-hydra++": 0}


def test_the_openai_api_takes_the_method_per_request(stack):
    from orchestrator.http import HttpConfig
    from orchestrator.http_server import start_http

    http = stack.loop.run(start_http(stack.servicer("hydra"), HttpConfig()))

    def post(**body):
        req = urllib.request.Request(f"{http.url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())["choices"][0]

    try:
        common = dict(prompt=PROMPTS[0], max_tokens=N, temperature=0, return_token_ids=True)
        plain = post(**common, method="vanilla")
        for method in ("eagle2", "static"):
            got = post(**common, method=method)
            assert got["token_ids"] == plain["token_ids"] and got["specdec"]["draft_tokens"] > 0
        assert plain["specdec"]["draft_tokens"] == 0
    finally:
        stack.loop.run(http.stop())
