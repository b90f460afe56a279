"""Prefix caching through the services (real gRPC, tiny family): output equal to
plain decoding, hits and saved tokens in both services' metrics, tenants (the
callers' bearer tokens) and request salts isolated, every session released."""

import pytest
import torch

from running_stack import Stack
from specdec.client import SpecdecClient
from specdec.model.prefix_cache import BLOCK_TOKENS as B
from specdec.request.params import backend_salt
from specdec.serving.metrics import REGISTRY

N = 10


@pytest.fixture(scope="module")
def stack(tiny_family):
    s = Stack(tiny_family)
    s.add_verifier("verifier", prefix_cache_tokens=16 * B)
    s.add_drafter("drafter", "eagle", prefix_cache_tokens=16 * B)
    for tenant in ("alice", "bob"):
        s.add_orchestrator(tenant, drafter="drafter", auth_token=f"{tenant}-token")
    yield s
    s.close()


def counter(name: str, role: str) -> float:
    return REGISTRY.get_sample_value(f"specdec_prefix_cache_{name}_total", {"role": role}) or 0.0


def complete(stack, tenant, prompt, **params):
    with SpecdecClient(stack.address(tenant), token=f"{tenant}-token", timeout=60) as client:
        return client.complete(prompt, max_new_tokens=N, method="eagle2", **params).token_ids


def test_hits_counted_output_unchanged_tenants_apart(stack, tiny_family):
    from serving.helpers import verifier_builder
    from specdec.local import generate
    from specdec.request.decoding import StopCriteria
    from specdec.request.params import SamplingParams

    vocab = stack.servicer("verifier").engine.target.vocab_size
    prompt = torch.randint(1, vocab, (2 * B + 6,), generator=torch.Generator().manual_seed(4)).tolist()
    want = generate(verifier_builder(tiny_family)(), None, prompt, SamplingParams(), StopCriteria(max_new_tokens=N),
                    None).tokens
    before = {(name, role): counter(name, role) for name in ("lookups", "hits", "saved_prefill_tokens")
              for role in ("verifier", "drafter")}

    def gained(name, role):
        return counter(name, role) - before[name, role]

    assert complete(stack, "alice", prompt) == want
    assert gained("lookups", "verifier") == 1 and gained("hits", "verifier") == 0
    assert complete(stack, "alice", prompt) == want          # the same tenant: both services hit
    assert gained("hits", "verifier") == gained("hits", "drafter") == 1
    assert gained("saved_prefill_tokens", "verifier") == gained("saved_prefill_tokens", "drafter") == 2 * B
    assert complete(stack, "bob", prompt) == want            # another tenant: no hit
    assert complete(stack, "alice", prompt, cache_salt="private") == want    # another salt: no hit
    assert gained("hits", "verifier") == gained("hits", "drafter") == 1
    assert gained("lookups", "verifier") == gained("lookups", "drafter") == 4
    tokens = REGISTRY.get_sample_value("specdec_prefix_cache_tokens", {"role": "verifier"})
    assert tokens == len(stack.servicer("verifier").engine.prefix.blocks) * B == 3 * 2 * B
    assert stack.wait_sessions_closed("verifier", "drafter") == {"verifier": 0, "drafter": 0}


def test_salts_are_digests_of_tenant_and_request_salt():
    assert backend_salt(None) == backend_salt("") == ""
    salts = {backend_salt("alice"), backend_salt("bob"), backend_salt("alice", "x"), backend_salt("", "x"),
             backend_salt("alic", "ex")}
    assert len(salts) == 5 and all(len(s) == 32 and "alice" not in s for s in salts)


def test_the_tokens_gauge_sums_the_roles_live_servers():
    """Two servers of one role in a process: the gauge is what both caches hold
    (the last one to update no longer hides the other), and a stopped one drops out."""
    from specdec.model.prefix_cache import CacheStats
    from specdec.serving.metrics import PrefixStats

    def held():
        return REGISTRY.get_sample_value("specdec_prefix_cache_tokens", {"role": "test-role"})

    a, b = PrefixStats("test-role"), PrefixStats("test-role")
    a.update(CacheStats(), 96)
    b.update(CacheStats(), 0)
    assert held() == 96
    b.update(CacheStats(), 32)
    assert held() == 128
    a.close()
    assert held() == 32
