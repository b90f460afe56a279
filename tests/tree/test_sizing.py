"""Trees sized by the verifier's measured cost (specdec.tree.sizing): the
rule, the cut, the measurements, and that a cut tree's acceptance maps back
onto the drafted tree."""

import itertools

import pytest
import torch

from specdec.request.knobs import check_tree_sizing
from specdec.tree.layout import DraftTree, tree_from_lists
from specdec.tree.proposals import Proposal
from specdec.tree.sizing import EXPLORE_EVERY, TreeSizer, best_size, monotone_values, restore, sizes_up_to, width_of

COSTS = {1: 3e-3, 2: 3.2e-3, 4: 5e-3, 8: 8e-3, 16: 10e-3}


def test_widths_and_sizes():
    assert [width_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 32]
    assert sizes_up_to(16) == [1, 2, 4, 8, 16]
    assert sizes_up_to(12) == [1, 2, 4, 8, 12]
    assert sizes_up_to(1) == [1] and sizes_up_to(2) == [1, 2]


def test_check_tree_sizing():
    assert check_tree_sizing("cost") == "cost"
    with pytest.raises(ValueError, match="must be one of cost, fixed, got 'auto'"):
        check_tree_sizing("auto")
    from verifier.engine import VerifierEngine

    with pytest.raises(ValueError, match="tree_sizing must be one of cost, fixed"):
        VerifierEngine(target=None, tree_sizing="auto")


def brute_force(accept, costs, rate, cap):
    """The rule written out: the size whose expected tokens minus rate x cost is largest (larger on ties)."""
    scored = [(sum(accept[:n - 1]) - rate * costs[width_of(n)], n) for n in sizes_up_to(cap)]
    return max(scored)[1]


@pytest.mark.parametrize("seed", range(40))
def test_best_size_is_the_rule(seed):
    gen = torch.Generator().manual_seed(seed)
    accept = torch.rand(15, generator=gen).sort(descending=True).values.tolist()
    rate = float(torch.rand(1, generator=gen)) * 800
    assert best_size(accept, COSTS, rate, 16) == brute_force(accept, COSTS, rate, 16)


def test_best_size_keeps_nodes_that_repay_their_time():
    sure = [1.0] * 15          # every node accepted: worth any verify time at these rates
    assert best_size(sure, COSTS, rate=300.0, cap=16) == 16
    hopeless = [0.01] * 15     # hardly any: the root alone (plain decoding) is best
    assert best_size(hopeless, COSTS, rate=300.0, cap=16) == 1
    # two sure nodes, the rest hopeless: a 4-node tree (3 drafted) is the cheapest that holds them
    assert best_size([1.0, 1.0] + [0.01] * 13, COSTS, rate=300.0, cap=16) == 4
    # a slow session (a low rate) values verify time less: it keeps the whole tree
    assert best_size([1.0, 1.0] + [0.2] * 13, COSTS, rate=10.0, cap=16) == 16


def valued(tokens, parents, values) -> DraftTree:
    tree = tree_from_lists(tokens, parents)
    return DraftTree(tree.tokens, tree.parents, tree.depths, torch.tensor(values, dtype=torch.float32))


def chain_and_branches():
    """Root 0; 1 (-0.1) -> 3 (-0.3) -> 5 (-0.9); 2 (-1.5) -> 4 (-2.0); 6 under 1 (-2.5)."""
    tokens = [10, 11, 12, 13, 14, 15, 16]
    parents = [-1, 0, 0, 1, 2, 3, 1]
    values = [0.0, -0.1, -1.5, -0.3, -2.0, -0.9, -2.5]
    return valued(tokens, parents, values)


def sizer_with(costs=COSTS, rate=300.0) -> TreeSizer:
    sizer = TreeSizer()
    sizer.costs = dict(costs)
    sizer.timed_at = {w: 0 for w in costs}
    sizer.warmed = set(costs)
    sizer.rate = rate
    return sizer


def test_cut_keeps_the_best_connected_nodes_and_maps_acceptance_back():
    tree = chain_and_branches()
    sizer = sizer_with()
    cut, keep = sizer.cut("s", tree, greedy=True)
    # exp(values) of the best: 0.90, 0.74, 0.41, 0.22, 0.14, 0.08: three repay a 4-wide verify at 300 tok/s
    assert keep.tolist() == [0, 1, 3, 5]
    assert cut.tokens.tolist() == [10, 11, 13, 15] and cut.parents.tolist() == [-1, 0, 1, 2]
    # accepting the cut tree's nodes 1 and 2 is accepting the drafted tree's 1 and 3
    assert restore([1, 2], keep) == [1, 3] and restore([], keep) == []
    assert restore([1, 2], None) == [1, 2]


def test_cut_leaves_what_must_not_be_cut():
    tree = chain_and_branches()
    sizer = sizer_with()
    assert sizer.cut("sampled", tree, greedy=False) == (tree, None)
    plain = valued([10, 11], [-1, 0], [0.0, -5.0])
    drawn = DraftTree(plain.tokens, plain.parents, plain.depths, plain.values,
                      {0: Proposal(torch.tensor([11]), torch.tensor([1.0]))})
    assert sizer.cut("s", drawn, greedy=True)[1] is None            # sampled proposals: accepted as drawn
    fresh = TreeSizer()                                             # no rate known yet: the whole tree
    assert fresh.cut("s", tree, greedy=True) == (tree, None)
    root = tree_from_lists([10], [-1])
    assert sizer.cut("s", root, greedy=True) == (root, None)


def test_a_child_valued_above_its_parent_is_capped_and_the_cut_stays_connected():
    # a remote drafter's values are not trusted: node 2's child 3 claims more than node 2
    tree = valued([10, 11, 12, 13], [-1, 0, 0, 2], [0.0, -0.2, -3.0, -0.1])
    assert monotone_values(tree).tolist() == pytest.approx([0.0, -0.2, -3.0, -3.0])
    sizer = sizer_with({1: 1e-3, 2: 1e-3, 4: 1e-3})
    for n in (2, 4):
        sizer.costs = {1: 1e-3, 2: 1e-3 if n == 2 else 9.0, 4: 9.0 if n == 2 else 1e-3}
        cut, keep = sizer.cut("s", tree, greedy=True)
        kept = keep.tolist() if keep is not None else list(range(tree.size))
        assert len(kept) == n and cut.size == n
        assert all(int(tree.parents[i]) in kept for i in kept[1:])  # every kept node's parent is kept
        assert n == 4 or kept == [0, 1]                              # 3 (claimed -0.1) ranks as its parent


def test_widths_are_timed_before_they_are_chosen():
    sizer = TreeSizer()
    sizer.rate = 300.0
    tree = chain_and_branches()        # 7 nodes: sizes 1, 2, 4, 7 (width 8)
    order = []
    for _ in range(8):
        cut, _ = sizer.cut("s", tree, greedy=True)
        order.append(cut.size)
        sizer.verified("s", cut.size, COSTS[width_of(cut.size)], 1)
    # the largest untimed size first, each verified twice (a width's first verify is not timed)
    assert order == [7, 7, 4, 4, 2, 2, 1, 1]
    assert sizer.costs == {w: pytest.approx(COSTS[w]) for w in (1, 2, 4, 8)}


def test_a_width_not_timed_for_a_while_is_timed_again():
    sizer = sizer_with()
    tree = chain_and_branches()
    sizer.verifies = EXPLORE_EVERY
    for w in (2, 4, 8):
        sizer.timed_at[w] = EXPLORE_EVERY
    cut, _ = sizer.cut("s", tree, greedy=True)
    assert cut.size == 1                                             # width 1 was last timed at verify 0


def test_one_stall_moves_an_average_boundedly():
    sizer = sizer_with()
    sizer.verified("s", 16, 10.0, 1)            # a 10 s stall on a 10 ms verify
    assert sizer.costs[16] <= 10e-3 * (1 + 0.25 * 2) + 1e-12


def test_session_rates_and_forgetting():
    sizer = TreeSizer()
    tree = chain_and_branches()
    for sid in ("a", "b"):
        sizer.cut(sid, tree, greedy=True)
        sizer.verified(sid, tree.size, 1e-3, 3)
    assert sizer.sessions["a"].rate is None                         # no whole cycle yet
    sizer.cut("a", tree, greedy=True)
    sizer.verified("a", tree.size, 1e-3, 4)
    assert sizer.sessions["a"].rate > 0 and sizer.rate == sizer.sessions["a"].rate
    sizer.forget("a")
    assert "a" not in sizer.sessions and "b" in sizer.sessions


def test_sessions_remembered_are_bounded(monkeypatch):
    import specdec.tree.sizing as ts

    monkeypatch.setattr(ts, "MAX_SESSIONS", 3)
    sizer = TreeSizer()
    tree = chain_and_branches()
    for sid in itertools.islice(map(str, itertools.count()), 10):
        sizer.cut(sid, tree, greedy=True)
    assert list(sizer.sessions) == ["7", "8", "9"]
