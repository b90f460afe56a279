"""The whole EAGLE-2 draft in one graph (``drafter.compiled.whole_draft``): it drafts
the level-by-level trees (values and the records drafting ahead reads
included), decides ties as the level path does, hands the ties it cannot decide
and the drafts it was not built for to the level path, keeps generations plain
greedy decoding, and a graph that fails to build or to match the level path is
dropped with one log line."""

from __future__ import annotations

import logging
import random
from dataclasses import replace

import pytest
import torch
from trees import assert_drafts_plain_greedy, assert_same_tree

from specdec.model import kv
from specdec.request.params import SamplingParams, TreeParams
from drafter.compiled import whole_draft
from drafter.compiled.head_levels import HEAD_CAPACITY
from drafter.eagle.eagle2 import EagleDrafter

DEFAULT = TreeParams()


@pytest.fixture(scope="module")
def drafters(tiny_family):
    """(drafter with the whole-draft graph, the same drafter drafting level by level, eager drafter)."""
    fast = EagleDrafter(tiny_family["eagle"], tiny_family["target"], compile="on")
    assert fast.compiled_tree is not None
    levels = EagleDrafter(tiny_family["eagle"], tiny_family["target"], compile="on")
    levels.compiled_tree = None
    return fast, levels, EagleDrafter(tiny_family["eagle"], tiny_family["target"])


def feed(drafters, sid, rng, gen, n, sampling=None):
    tokens = [rng.randrange(drafters[0].vocab_size) for _ in range(n)]
    feats = torch.randn(n - 1, drafters[0].hidden_size, generator=gen)
    for d in drafters:
        d.prefill(sid, tokens, feats, greedy=sampling is None, sampling=sampling)


def commit(drafters, sid, rng, gen):
    n = rng.randrange(1, 7)
    tokens = [rng.randrange(drafters[0].vocab_size) for _ in range(n)]
    feats = torch.randn(n, drafters[0].hidden_size, generator=gen)
    for d in drafters:
        d.commit(sid, tokens, feats)


def test_the_graph_drafts_the_level_by_level_trees_and_records(drafters):
    fast, levels, eager = drafters
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    served = fast.compiled_tree.drafts
    drafts = 0
    for i, prompt in enumerate((3, 40, 17)):
        sid = f"g{i}"
        feed(drafters, sid, rng, gen, prompt)
        for _ in range(5):
            trees = [d.draft(sid, DEFAULT, ahead=True) for d in drafters]      # (ahead: keep the record)
            assert_same_tree(trees[0], trees[1])
            assert_same_tree(trees[0], trees[2])
            records = [d.sessions.get(sid).record for d in (fast, levels)]
            assert torch.allclose(records[0].hidden, records[1].hidden, atol=1e-5)
            drafts += 1
            commit(drafters, sid, rng, gen)
        sess = fast.sessions.get(sid)
        assert kv.seq_len(sess.cache) == sess.fed                   # the draft's slots were dropped
    assert fast.compiled_tree.drafts == served + drafts             # every one took the graph


def test_shallower_trees_of_its_budget_take_the_graph_and_are_the_level_paths(drafters):
    """A request's last cycles draft no deeper than the tokens left: the graph serves them."""
    fast, levels, _ = drafters
    rng, gen = random.Random(4), torch.Generator().manual_seed(4)
    feed((fast, levels), "shallow", rng, gen, 10)
    served = fast.compiled_tree.drafts
    depths = range(1, fast.compiled_tree.levels + 1)
    for depth in depths:
        cfg = replace(DEFAULT, depth=depth)
        trees = [d.draft("shallow", cfg, ahead=True) for d in (fast, levels)]
        assert_same_tree(*trees)
        assert int(trees[0].depths.max()) <= depth
        records = [d.sessions.get("shallow").record for d in (fast, levels)]
        assert torch.allclose(records[0].hidden, records[1].hidden, atol=1e-5)   # drafting ahead's inputs
        commit((fast, levels), "shallow", rng, gen)
    assert fast.compiled_tree.drafts == served + len(depths)


def test_drafting_ahead_after_a_whole_draft_matches_the_level_path(drafters):
    fast, levels, _ = drafters
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    feed((fast, levels), "ahead", rng, gen, 12)
    trees = [d.draft("ahead", DEFAULT, ahead=True) for d in (fast, levels)]
    assert_same_tree(*trees)
    got = [d.draft_ahead("ahead", [], None, DEFAULT, 3, 64) for d in (fast, levels)]   # from the records
    assert len(got[0]) == len(got[1]) > 0
    for (commit_a, tree_a), (commit_b, tree_b) in zip(*got):
        assert commit_a == commit_b
        assert_same_tree(tree_a, tree_b)


def test_ties_in_a_top_k_are_decided_in_the_graph_as_the_level_path_decides_them(drafters):
    """Root log-probs whose two best tie (a half-precision head's often do): the
    graph serves the draft, and its tree is the level path's (the lower id first)."""
    fast, levels, _ = drafters
    rng, gen = random.Random(5), torch.Generator().manual_seed(5)
    feed((fast, levels), "tied", rng, gen, 9)
    hidden, logp = fast.sessions.get("tied").root_out
    tied = logp.clone()
    best = tied.topk(2).indices
    tied[best[1]] = float(tied[best[0]])
    tied = tied - torch.logsumexp(tied, -1)
    for d in (fast, levels):
        d.sessions.get("tied").root_out = (hidden, tied)
    served = fast.compiled_tree.drafts
    trees = [d.draft("tied", DEFAULT) for d in (fast, levels)]
    assert fast.compiled_tree.drafts == served + 1
    assert_same_tree(*trees)
    assert trees[0].tokens[1:3].tolist() == sorted(best.tolist())


def test_ties_the_graph_cannot_decide_hand_the_draft_to_the_level_path(drafters):
    fast, _, _ = drafters
    whole = fast.compiled_tree
    cache = fast.new_cache()
    with torch.inference_mode():
        fast.head(fast.embed_tokens(torch.tensor([[1, 2, 3]])), torch.zeros(1, 3, fast.hidden_size),
                  torch.arange(3)[None], None, cache)
    root = torch.zeros(fast.hidden_size)
    tied = torch.full((fast.vocab_size,), -float("inf"))
    tied[[4, 9]] = torch.log(torch.tensor(0.5))                    # every other token ties at the k-th place
    served = whole.drafts
    assert whole.draft(cache, 3, root, tied, 1.0) is None
    nan = torch.log_softmax(torch.randn(fast.vocab_size), dim=-1)
    nan[7] = float("nan")
    assert whole.draft(cache, 3, root, nan, 1.0) is None          # the level path raises its error
    distinct = torch.log_softmax(torch.randn(fast.vocab_size, generator=torch.Generator().manual_seed(2)), -1)
    assert whole.draft(cache, 3, root, distinct, 1.0) is not None
    assert whole.drafts == served + 1 and kv.seq_len(cache) == 3


@pytest.mark.parametrize("cfg, sampling", [
    (TreeParams(total_tokens=8, depth=3, expand_k=2), None),                 # another budget
    (TreeParams(method="chain", total_tokens=6, depth=5), None),             # another method
    (DEFAULT, SamplingParams(temperature=0.8, seed=5)),                      # sampled proposals
])
def test_drafts_it_was_not_built_for_go_level_by_level(drafters, cfg, sampling):
    fast, levels, _ = drafters
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    feed((fast, levels), "other", rng, gen, 9, sampling)
    served = fast.compiled_tree.drafts
    assert_same_tree(fast.draft("other", cfg), levels.draft("other", cfg))
    assert fast.compiled_tree.drafts == served


def test_a_draft_past_the_head_capacity_is_not_served(drafters):
    whole = drafters[0].compiled_tree
    room = HEAD_CAPACITY - (whole.levels - 1) * whole.expand_k
    assert whole.serves(DEFAULT, room) and not whole.serves(DEFAULT, room + 1)


def test_generation_with_the_whole_draft_graph_is_plain_greedy_decoding(drafters, tiny_family):
    fast = drafters[0]
    served = fast.compiled_tree.drafts
    assert_drafts_plain_greedy(fast, tiny_family["target"], DEFAULT)
    assert fast.compiled_tree.drafts > served


def test_a_graph_that_fails_to_build_drafts_level_by_level_with_one_line(tiny_family, caplog, monkeypatch):
    def broken(self):
        raise RuntimeError("no C++ compiler\nsecond line")

    monkeypatch.setattr(whole_draft.CompiledTree, "warm", broken)
    with caplog.at_level(logging.WARNING, logger="drafter.compiled.whole_draft"):
        drafter = EagleDrafter(tiny_family["eagle"], tiny_family["target"], compile="on")
    assert drafter.compiled is not None and drafter.compiled_tree is None
    lines = [r.getMessage() for r in caplog.records if r.name == "drafter.compiled.whole_draft"]
    assert len(lines) == 1
    assert "RuntimeError: no C++ compiler" in lines[0] and "second line" not in lines[0]


def test_a_graph_whose_trees_differ_is_refused(tiny_family, caplog, monkeypatch):
    real = whole_draft.CompiledTree.draft

    def off_by_a_little(self, *args):
        got = real(self, *args)
        if got is None:
            return None
        tree, hidden = got
        return type(tree)(tree.tokens, tree.parents, tree.depths, tree.values - 0.01), hidden

    monkeypatch.setattr(whole_draft.CompiledTree, "draft", off_by_a_little)
    with caplog.at_level(logging.WARNING, logger="drafter.compiled.whole_draft"):
        drafter = EagleDrafter(tiny_family["eagle"], tiny_family["target"], compile="on")
    assert drafter.compiled_tree is None
    assert any("values differ" in r.getMessage() for r in caplog.records)


def test_a_run_that_names_its_budget_drafts_it_whole(tiny_family):
    fast = EagleDrafter(tiny_family["eagle"], tiny_family["target"], compile="on")
    levels = EagleDrafter(tiny_family["eagle"], tiny_family["target"])
    small = TreeParams(total_tokens=8, depth=3, expand_k=2)
    whole_draft.use_budget(fast, small)
    assert fast.compiled_tree.serves(small, 0) and not fast.compiled_tree.serves(DEFAULT, 0)
    rng, gen = random.Random(5), torch.Generator().manual_seed(5)
    feed((fast, levels), "small", rng, gen, 11)
    served = fast.compiled_tree.drafts
    for _ in range(3):
        assert_same_tree(fast.draft("small", small), levels.draft("small", small))
        commit((fast, levels), "small", rng, gen)
    assert fast.compiled_tree.drafts == served + 3
    whole = fast.compiled_tree
    whole_draft.use_budget(fast, small)                      # served already: kept as it is
    assert fast.compiled_tree is whole


def test_a_budget_whose_graph_fails_its_check_keeps_the_graph_the_drafter_had(drafters, monkeypatch):
    fast = drafters[0]
    had = fast.compiled_tree
    real = whole_draft.CompiledTree.draft

    def off_for_the_new_budget(self, *args):
        got = real(self, *args)
        if got is None or self is had:
            return got
        tree, hidden = got
        return type(tree)(tree.tokens, tree.parents, tree.depths, tree.values - 0.01), hidden

    monkeypatch.setattr(whole_draft.CompiledTree, "draft", off_for_the_new_budget)
    whole_draft.use_budget(fast, TreeParams(total_tokens=8, depth=3, expand_k=2))
    assert fast.compiled_tree is had and had.serves(DEFAULT, 0)


def test_a_drafter_service_drafts_its_default_tree_whole(tiny_family):
    from specdec.cli import serve
    from specdec.cli.main import build_parser

    args = build_parser().parse_args(["drafter", "serve", "--eagle", str(tiny_family["eagle"]), "--target",
                                      str(tiny_family["target"]), "--compile", "on", "--total-tokens", "8",
                                      "--depth", "3", "--expand-k", "2"])
    default = TreeParams(total_tokens=8, depth=3, expand_k=2)
    drafter = serve._drafter_builder(args, default)()
    assert drafter.compiled_tree.serves(default, 0) and not drafter.compiled_tree.serves(DEFAULT, 0)
