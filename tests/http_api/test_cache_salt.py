"""Prefix-cache isolation over HTTP: the caller's bearer token and the body's
``cache_salt`` decide which cached prompt prefixes a request may reuse."""

from __future__ import annotations

import json

import httpx
import pytest

from http_api.helpers import TOKEN
from specdec.model.prefix_cache import BLOCK_TOKENS as B
from verifier.prefix import TargetPrefixCache

PROMPT = "def add(a, b):\n    return a + b\n\n" * 12


@pytest.fixture
def cache(api):
    """The stack's verifier with a prefix cache for this test (put back as it was after)."""
    engine = api.stack.servicer("verifier").engine
    before = engine.prefix
    engine.prefix = TargetPrefixCache(engine.target, 32 * B)
    yield engine.prefix.blocks
    engine.prefix = before


def complete(api, server: str, token: str | None = None, **extra) -> list[int]:
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {token}"} if token else {})}
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "return_token_ids": True, **extra}
    resp = httpx.post(api.root(server) + "/v1/completions", content=json.dumps(body), headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def test_the_bearer_token_and_the_cache_salt_keep_tenants_apart(api, cache):
    first = complete(api, "auth", TOKEN)
    assert cache.stats.lookups == 1 and cache.stats.hits == 0 and len(cache) >= 1     # the prompt spans a block
    assert complete(api, "auth", TOKEN) == first and cache.stats.hits == 1
    assert complete(api, "auth", TOKEN, cache_salt="mine") == first                    # another salt
    assert complete(api, "eagle") == first                                             # no token: another tenant
    assert cache.stats.lookups == 4 and cache.stats.hits == 1
    assert complete(api, "eagle") == first and cache.stats.hits == 2
