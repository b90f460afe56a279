"""The in-place KV cache (specdec.kvcache): the same contents as transformers'
DynamicCache through appends, truncations and path commits, without moving
the prefix, and the same model outputs."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_llama
from transformers import DynamicCache

from specdec.model import kv
from specdec.model.kv import SlabLayer, new_cache

HEADS, DIM = 2, 4


def _kv(n: int, start: float = 0.0, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.arange(batch * HEADS * n * DIM, dtype=torch.float32).view(batch, HEADS, n, DIM) + start
    return k, -k


def _pair(capacity: int = 0):
    """A one-layer DynamicCache and a one-layer slab cache to run side by side."""
    ref, slab = DynamicCache(), DynamicCache()
    slab.layers = [SlabLayer(capacity)]
    return ref, slab


def _same(ref, slab) -> None:
    assert kv.seq_len(ref) == kv.seq_len(slab) == slab.get_seq_length()
    assert torch.equal(ref.layers[0].keys, slab.layers[0].keys)
    assert torch.equal(ref.layers[0].values, slab.layers[0].values)


def test_appends_truncations_and_path_commits_match_dynamic_cache():
    ref, slab = _pair()
    for step, n in enumerate([7, 1, 5, 3, 9, 2]):
        k, v = _kv(n, start=1000.0 * step)
        ref.update(k, v, 0)
        slab.update(k, v, 0)
        _same(ref, slab)
        length = kv.seq_len(ref)
        if step % 2:                                   # a rejected tree: drop the last slots
            kv.truncate(ref, length - 1)
            kv.truncate(slab, length - 1)
        else:                                          # an accepted path through the new slots
            prefix = length - n
            path = [0] + [i for i in range(1, n) if i % 2 == 0]
            kv.keep_path(ref, prefix, path)
            kv.keep_path(slab, prefix, path)
        _same(ref, slab)


def test_room_is_reserved_once_and_the_prefix_never_moves():
    ref, slab = _pair(capacity=40)
    slab.update(*_kv(10), 0)
    layer = slab.layers[0]
    buffer, cap = layer.keys.data_ptr(), layer.capacity
    assert cap == 40
    for step in range(6):                               # 6 trees of 4, each keeping 2 slots
        prefix = kv.seq_len(slab)
        slab.update(*_kv(4, start=100.0 * step), 0)
        kv.keep_path(slab, prefix, [0, 3])
    assert kv.seq_len(slab) == 22
    assert layer.keys.data_ptr() == buffer and layer.capacity == cap
    assert kv.nbytes(slab) == 2 * 40 * HEADS * DIM * 4  # what is held, spare room included


def test_a_full_buffer_grows_and_keeps_its_contents():
    ref, slab = _pair(capacity=8)
    for step in range(12):
        k, v = _kv(5, start=10.0 * step)
        ref.update(k, v, 0)
        slab.update(k, v, 0)
    _same(ref, slab)
    assert slab.layers[0].capacity >= 60


def test_rebinding_keys_like_transformers_code_stays_correct():
    ref, slab = _pair(capacity=32)
    for cache in (ref, slab):
        cache.update(*_kv(10), 0)
        cache.crop(-3)                                  # transformers rebinds keys/values to views
        cache.update(*_kv(3, start=500.0), 0)
    _same(ref, slab)


def test_batch_rows_selected_with_their_room():
    slab = DynamicCache()
    slab.layers = [SlabLayer()]
    k, v = _kv(6, batch=3)
    kv.adopt(slab, 0, torch.cat([k, torch.zeros(3, HEADS, 10, DIM)], dim=2),
             torch.cat([v, torch.zeros(3, HEADS, 10, DIM)], dim=2), 6)
    kv.select_rows(slab, torch.tensor([0, 2]))
    layer = slab.layers[0]
    assert layer.capacity == 16 and kv.seq_len(slab) == 6
    assert torch.equal(layer.keys, k[[0, 2]]) and torch.equal(layer.values, v[[0, 2]])
    slab.update(*_kv(2, start=7.0, batch=2), 0)
    assert torch.equal(layer.keys[:, :, 6:], _kv(2, start=7.0, batch=2)[0])
    with pytest.raises(ValueError, match="batch of 1 rows to a cache of 2"):
        slab.update(*_kv(1), 0)                  # never broadcast into the other rows
    assert kv.seq_len(slab) == 8


@torch.inference_mode()
def test_model_outputs_equal_with_either_cache():
    """Prompt, then tree-shaped chunks committed down a path, then more tokens:
    logits with the slab cache equal those with transformers' own."""
    model = tiny_llama(97, seed=3)
    ref, slab = DynamicCache(config=model.config), new_cache(model.config, capacity=24)
    torch.manual_seed(0)
    prompt = torch.randint(1, 97, (1, 9))
    outs = []
    for cache in (ref, slab):
        out = [model(prompt, use_cache=True, **kv.with_cache(model, cache)).logits]
        length = 9
        for step in range(5):                           # a chain of 4 "tree" nodes, keep nodes 0 and 2
            ids = torch.randint(1, 97, (1, 4), generator=torch.Generator().manual_seed(step))
            pos = torch.arange(length, length + 4)[None]
            out.append(model(ids, position_ids=pos, use_cache=True, **kv.with_cache(model, cache)).logits)
            kv.keep_path(cache, length, [0, 2])
            length += 2
        outs.append(torch.cat([o.flatten() for o in out]))
        assert kv.seq_len(cache) == length
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    for a, b in zip(ref.layers, slab.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-6) and torch.allclose(a.values, b.values, atol=1e-6)


def test_gather_rows_and_append_slots_round_trip():
    """Sessions' caches copied into one padded batch cache, and a batch row's
    new slots appended back, give each session exactly its own slots."""
    sessions = []
    for b, n in enumerate((3, 0, 5)):
        cache = DynamicCache()
        cache.layers = [SlabLayer()]
        if n:
            kv.append(cache, 0, *_kv(n, start=100.0 * b))
        sessions.append(cache)
    batch = DynamicCache()
    batch.layers = [SlabLayer()]
    kv.gather_rows(batch, sessions, [3, 0, 5], width=5, room=4)
    layer = batch.layers[0]
    assert kv.seq_len(batch) == 5 and layer.capacity == 9
    assert torch.equal(layer.keys[0, :, :3], sessions[0].layers[0].keys[0])
    assert torch.equal(layer.keys[2], sessions[2].layers[0].keys[0])
    assert not layer.keys[0, :, 3:].any() and not layer.keys[1].any()      # padding is zeros, never NaN
    new_k, new_v = _kv(2, start=-500.0, batch=3)
    kv.append(batch, 0, new_k, new_v)                    # a forward writes the next slots in place
    kv.append_slots(sessions[0], batch, 0, torch.tensor([5, 6]))
    assert kv.seq_len(sessions[0]) == 5
    assert torch.equal(sessions[0].layers[0].keys[0, :, 3:], new_k[0])
    assert torch.equal(sessions[0].layers[0].values[0, :, 3:], new_v[0])


def test_sliding_layers_hold_the_whole_sequence_and_recurrent_ones_are_refused():
    from transformers import MistralConfig, Qwen3NextConfig

    cache = new_cache(MistralConfig(num_hidden_layers=2, sliding_window=4))
    assert [type(layer) for layer in cache.layers] == [SlabLayer, SlabLayer]
    with pytest.raises(ValueError, match="linear_attention"):
        new_cache(Qwen3NextConfig(num_hidden_layers=4))
