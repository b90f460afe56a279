"""specdec.tree.placed and what runs on it on the device: the masks built from a
placed tree's bits are the host's padded masks bit for bit, the greedy walk as
bit-set operations orders the nodes as ``accept_greedy`` walks them, the
cache reordered by it keeps what ``keep_path`` keeps, and a root placed from
its token on the device is the host's placed root."""

import random

import pytest
import torch
from transformers import LlamaConfig

from specdec.compile.fixed_kv import padded
from specdec.model import kv
from specdec.model.masks import FULL, SLIDING, AttentionLayout, tree_allowed
from specdec.tree.acceptance import accept_greedy, greedy_order
from specdec.tree.build import tree_from_lists
from specdec.tree.placed import BITS, MAX_WIDTH, SEEN, place_root, place_tree

CONFIG = LlamaConfig(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=2,
                     intermediate_size=16, vocab_size=32)


def random_tree(rng: random.Random, n: int, vocab: int = 4):
    """A tree of ``n`` nodes over a small vocabulary (twin siblings are common)."""
    parents, depths = [-1], [0]
    for i in range(1, n):
        p = rng.randrange(i)
        parents.append(p)
        depths.append(depths[p] + 1)
    order = sorted(range(n), key=lambda i: (depths[i], i))          # nodes by depth, parents before children
    index = {old: new for new, old in enumerate(order)}
    tokens = [rng.randrange(vocab) for _ in range(n)]
    return tree_from_lists([tokens[i] for i in order], [-1] + [index[parents[i]] for i in order[1:]])


def test_the_rows_hold_the_tree_and_its_pads():
    tree = tree_from_lists([9, 1, 2, 3], [-1, 0, 0, 1])
    placed = place_tree(tree, 10, 8, "cpu")
    assert placed.n == 4 and placed.width == 8 and placed.prefix_len == 10
    assert placed.tokens.tolist() == [[9, 1, 2, 3, 0, 0, 0, 0]]
    assert placed.positions.tolist() == [[10, 11, 11, 12, 12, 12, 12, 12]]
    assert placed.slots.tolist() == list(range(10, 18))
    assert placed.packed[SEEN].tolist() == [0b1, 0b11, 0b101, 0b1011, 1 << 4, 1 << 5, 1 << 6, 1 << 7]
    with pytest.raises(ValueError, match="at most 64"):
        place_tree(tree_from_lists([1] * 65, [-1] + [0] * 64), 0, 128, "cpu")


def test_a_64_wide_tree_uses_the_sign_bit():
    tree = tree_from_lists(list(range(MAX_WIDTH)), [-1] + list(range(MAX_WIDTH - 1)))      # a chain
    placed = place_tree(tree, 0, MAX_WIDTH, "cpu")
    assert placed.packed[BITS, -1].item() == -(1 << 63)
    assert placed.packed[SEEN, -1].item() == -1                      # the last node sees every slot
    best = torch.tensor(list(range(1, MAX_WIDTH)) + [5])
    assert greedy_order(placed, best).tolist() == list(range(MAX_WIDTH))


@pytest.mark.parametrize("seed", range(40))
def test_greedy_order_walks_as_accept_greedy(seed):
    rng = random.Random(seed)
    n = rng.choice([2, 3, 5, 8, 16, 33, 64])
    tree = random_tree(rng, n)
    placed = place_tree(tree, rng.randrange(50), 64 if n > 32 else 32 if n > 16 else 16, "cpu")
    for _ in range(10):
        best = torch.tensor([rng.randrange(4) for _ in range(n)])
        path = [0] + accept_greedy(tree, best).accepted
        assert greedy_order(placed, best)[:len(path)].tolist() == path


def test_a_later_twin_never_steps():
    # nodes 1 and 2 both carry 7; only node 2 has a matching child, the walk stops at 1
    tree = tree_from_lists([0, 7, 7, 3], [-1, 0, 0, 2])
    best = torch.tensor([7, 5, 3, 1])
    assert accept_greedy(tree, best).accepted == [1]
    assert greedy_order(place_tree(tree, 0, 4, "cpu"), best)[:2].tolist() == [0, 1]


@pytest.mark.parametrize("layout", [AttentionLayout((FULL, FULL)), AttentionLayout((SLIDING,), 3),
                                    AttentionLayout((FULL, SLIDING), 2)], ids=["full", "sliding", "mixed"])
@pytest.mark.parametrize("past", [0, 5])
def test_bits_masks_are_the_padded_host_masks(layout, past):
    tree = tree_from_lists([9, 1, 2, 3, 4], [-1, 0, 0, 1, 3])
    width, capacity = 8, 32
    placed = place_tree(tree, past, width, "cpu")
    positions = tree.position_ids(past)
    k_pos = torch.cat([torch.arange(past), positions])
    host = padded(layout.masks(tree_allowed(tree.ancestor_mask(), past)[None], positions[None], k_pos[None],
                               torch.bfloat16), width, capacity)
    got = layout.bits_masks(placed.packed[SEEN], placed.packed[BITS], placed.positions[0], past, tree.size,
                            capacity, torch.bfloat16)
    host, got = (host, got) if isinstance(host, dict) else ({"": host}, {"": got})
    assert host.keys() == got.keys()
    for kind in host:
        assert got[kind].dtype == torch.bfloat16 and torch.equal(got[kind], host[kind]), kind


def test_the_reordered_cache_keeps_what_keep_path_keeps():
    torch.manual_seed(0)
    tree = tree_from_lists([9, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 2, 4])
    prefix, path = 7, [0, 2, 4, 5]

    def filled():
        cache = kv.new_cache(CONFIG, 0)
        for i in range(2):
            kv.append(cache, i, torch.randn(1, 2, prefix + tree.size, 4), torch.randn(1, 2, prefix + tree.size, 4))
        return cache

    torch.manual_seed(1)
    want = filled()
    torch.manual_seed(1)
    got = filled()
    kv.keep_path(want, prefix, path)
    order = greedy_order(place_tree(tree, prefix, 8, "cpu"), torch.tensor([2, 0, 4, 0, 5, 1]))
    kv.reorder_tail(got, prefix, order)
    kv.truncate(got, prefix + len(path))
    for a, b in zip(want.layers, got.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("width", [1, 2, 8])
def test_a_root_placed_from_the_device_is_the_hosts(width):
    for prefix, token in ((0, 3), (17, 0), (250, 31)):
        got = place_root(torch.tensor([token]), prefix, width)
        want = place_tree(tree_from_lists([token], [-1]), prefix, width, "cpu")
        assert torch.equal(got.packed, want.packed) and (got.n, got.prefix_len) == (1, prefix)
