"""Sampled trees drafted on the device (``specdec.tree.drawn``): the tree the
host reads is a valid sampled tree (each expanded node's proposal holds its
drawn children, the level budget spent), the tree left unread on the device
is placed exactly as the verifier would place the tree it reads, and its
proposals table names the same proposals; a proposal cut short by the
filters leaves dead nodes that the walk can never take."""

import pytest
import torch

from specdec.request.params import SamplingParams, TreeParams
from specdec.tree import drawn
from specdec.tree.acceptance import sampled_order
from specdec.tree.placed import STEP, DeviceTree, place_tree
from specdec.tree.proposals import check_proposals
from drafter.eagle.eagle2 import EagleDrafter

CFG = TreeParams(total_tokens=12, depth=4, expand_k=3, proposals="sampled")


@pytest.fixture(scope="module")
def drafter(tiny_family):
    return EagleDrafter(str(tiny_family["eagle"]), str(tiny_family["target"]))


def _session(drafter, sid: str, params: SamplingParams):
    gen = torch.Generator().manual_seed(len(sid))
    tokens = torch.randint(0, drafter.vocab_size, (9,), generator=gen).tolist()
    drafter.prefill(sid, tokens, torch.randn(8, drafter.feature_size, generator=gen), sampling=params)
    return len(tokens)


@pytest.mark.parametrize("params", [SamplingParams(1.0, seed=1), SamplingParams(0.7, top_p=0.5, seed=2),
                                    SamplingParams(1.0, top_k=2, seed=3)], ids=["plain", "top_p", "top_k"])
def test_a_tree_drafted_on_the_device_is_placed_as_the_verifier_places_it(drafter, params):
    sid = f"drawn-{params.seed}"
    n_tokens = _session(drafter, sid, params)
    try:
        for _ in range(3):
            tree = drafter.draft(sid, CFG, deferred=True)
            assert isinstance(tree, DeviceTree) and tree.table is not None
            host = tree.materialize()                                   # the one read
            n, pool = host.size, tree.placed.n
            budget = drawn.level_widths(CFG)
            assert 2 <= n <= pool == 1 + sum(budget)
            if params.top_k == 0 and params.top_p == 1.0:
                assert n == pool                                        # nothing cut short: no dead node
            check_proposals(host.proposals, host.token_list, host.parent_list, drafter.vocab_size)
            assert set(host.proposals) == {i for i, kids in enumerate(host.children()) if kids}
            want = place_tree(host, n_tokens - 1, tree.placed.width, "cpu").packed
            got = tree.placed.packed
            assert torch.equal(got[:, :n], want[:, :n])
            assert not got[STEP, n:pool].any()                          # dead nodes: never taken
            table = tree.table
            for row, node in enumerate(table.nodes.tolist()):
                if node < pool:
                    prop = host.proposals[node]
                    m = prop.tokens.shape[0]
                    assert table.tokens[row, :m].tolist() == prop.tokens.tolist()
                    assert torch.allclose(table.probs[row, :m], prop.probs) and not table.probs[row, m:].any()
            # the walk over the placed tree only ever takes real nodes
            probs = torch.softmax(torch.randn(pool, drafter.vocab_size), -1)
            for seed in range(20):
                order, tail = sampled_order(tree.placed, probs, torch.Generator().manual_seed(seed), table)
                kept = int(tail[0])
                assert all(int(i) < n for i in order[:kept])
    finally:
        drafter.release(sid)


def test_without_a_fallback_the_draft_is_read_as_a_host_tree(drafter):
    sid = "drawn-host"
    _session(drafter, sid, SamplingParams(1.0, seed=5))
    try:
        tree = drafter.draft(sid, CFG)
        assert not isinstance(tree, DeviceTree) and tree.proposals
        assert tree.size == 1 + sum(drawn.level_widths(CFG))
    finally:
        drafter.release(sid)
