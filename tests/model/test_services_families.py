"""Every family of the matrix through the real services (gRPC on 127.0.0.1,
port 0): verifier and draft-LM drafter batching concurrent sessions,
orchestrators with and without a drafter. Every method's output equals plain
decoding's, as in-process (``test_families``)."""

from concurrent.futures import ThreadPoolExecutor

import pytest
from families import FAMILIES
from running_stack import Stack

from specdec.client import SpecdecClient

PROMPTS = ["def add(a, b):", "for i in range(3):\n", "class Point:", "import os\n"]
N = 16


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_services_speculate_token_identical(family, family_dir):
    name, path = family.name, family_dir(family)
    stack = Stack({"target": path, "draft-lm": path, "tokenizer": path})
    try:
        stack.add_verifier("verifier", batch_window_ms=20.0)
        stack.add_drafter("drafter", "draft-lm", batch_window_ms=20.0)
        stack.add_orchestrator("plain")
        stack.add_orchestrator("spec", drafter="drafter")

        def run(args):
            server, prompt, method = args
            with SpecdecClient(stack.address(server), timeout=60) as client:
                return client.complete(prompt, max_new_tokens=N, method=method)

        want = [run(("plain", p, "vanilla")).token_ids for p in PROMPTS]
        for method in ("eagle2", "chain", "static"):
            with ThreadPoolExecutor(len(PROMPTS)) as pool:         # concurrent: batched verifies and drafts
                got = list(pool.map(run, [("spec", p, method) for p in PROMPTS]))
            assert [g.token_ids for g in got] == want, f"{name}/{method}"
            assert sum(g.stats.accepted_tokens for g in got) > 0
    finally:
        stack.close()
