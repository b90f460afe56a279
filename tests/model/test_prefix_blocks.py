"""The prefix cache's blocks (``specdec.model.prefix_cache``): chained keys,
the longest cached prefix, LRU under a token budget evicting a chain from its
tail, eviction for room, the lookup limit that leaves a prefill something to run."""

import pytest

from specdec.model import prefix_cache as pc

B = pc.BLOCK_TOKENS


def keys(tokens, salt=""):
    return pc.token_keys(pc.namespace("model", salt), tokens)


def fill(cache, ks):
    cache.insert(ks, lambda j: (f"block{j}", 10))


def test_keys_chain_the_whole_prefix_and_the_namespace():
    a = list(range(3 * B + 5))
    b = a[:B] + [a[B] + 1] + a[B + 1:]                # differs in block 1 only
    ka, kb = keys(a), keys(b)
    assert len(ka) == 3                               # whole blocks only
    assert ka[0] == kb[0] and ka[1] != kb[1] and ka[2] != kb[2]    # a later block names everything before it
    assert keys(a, "tenant-1")[0] != ka[0] != keys(a, "tenant-2")[0]


def test_match_finds_the_longest_cached_prefix_and_counts_it():
    cache = pc.PrefixCache(100 * B)
    ks = keys(list(range(4 * B)))
    fill(cache, ks[:2])
    assert cache.match(ks) == ["block0", "block1"]
    assert cache.match(ks, limit=1) == ["block0"]
    assert cache.match(keys(list(range(1, 4 * B)))) == []
    s = cache.stats
    assert (s.lookups, s.hits, s.hit_tokens, s.saved_tokens) == (3, 2, 4 * B, 3 * B)


def test_lru_under_the_token_budget_evicts_a_chain_from_its_tail():
    cache = pc.PrefixCache(3 * B)
    old, new = keys([1] * 2 * B), keys([2] * 2 * B)
    fill(cache, old)
    fill(cache, new)                                  # 4 blocks for a budget of 3: the oldest goes
    assert cache.tokens == 3 * B and cache.stats.evictions == 1
    assert cache.match(old) == ["block0"]             # old's tail went, its head stays usable
    assert cache.match(new) == ["block0", "block1"]
    fill(cache, keys([3] * B))
    assert cache.match(old) == []                     # least recently used now: old's head
    assert cache.stats.evicted_tokens == 2 * B


def test_evict_bytes_makes_room_and_a_zero_budget_keeps_nothing():
    cache = pc.PrefixCache(10 * B)
    fill(cache, keys([5] * 3 * B))
    assert cache.nbytes == 30
    assert cache.evict_bytes(15) == 20 and cache.nbytes == 10 and len(cache) == 1
    off = pc.PrefixCache(0)
    fill(off, keys([5] * 3 * B))
    assert not off.on and len(off) == 0
    with pytest.raises(ValueError):
        pc.PrefixCache(-1)


def test_a_prefill_always_runs_something_from_a_block_boundary():
    assert [pc.usable(n) for n in (1, B, B + 1, 2 * B, 2 * B + 1)] == [0, 0, 1, 1, 2]
    assert pc.chunks(B, 2 * B + 3) == [(B, 2 * B), (2 * B, 2 * B + 3)]
