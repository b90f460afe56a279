"""Top-token trees drafted on the device (``specdec.tree.ranked``): for every
method it serves, an eager head's and a draft LM's, the tree is the one the
host's level-by-level builder drafts from the same log-probs, values
included, and left unread it is placed as the verifier places it; a tie in
a level's top-k flags the draft, whose reader takes the level-by-level one."""

from dataclasses import replace

import pytest
import torch
from trees import assert_same_tree

from specdec.model.loading import ModelSpec
from specdec.request.params import SamplingParams, TreeParams
from specdec.tree import ranked
from specdec.tree.placed import DeviceTree, place_tree
from drafter.draft_lm import DraftLmDrafter
from drafter.eagle.eagle2 import EagleDrafter

CASES = [TreeParams(total_tokens=12, depth=4, expand_k=3), TreeParams(method="no-value", total_tokens=10, depth=3),
         TreeParams(method="no-rerank", total_tokens=9, depth=4, expand_k=2),
         TreeParams(method="chain", total_tokens=6, depth=8),
         TreeParams(total_tokens=16, depth=6, expand_k=4, value_temperature=0.5)]


@pytest.fixture(scope="module")
def drafters(tiny_family):
    return {"eagle": EagleDrafter(str(tiny_family["eagle"]), str(tiny_family["target"])),
            "draft-lm": DraftLmDrafter(ModelSpec(str(tiny_family["draft-lm"])))}


def _session(drafter, sid: str, seed: int) -> int:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, drafter.vocab_size, (9,), generator=gen).tolist()
    feats = torch.randn(8, drafter.feature_size, generator=gen) if drafter.needs_features else None
    drafter.prefill(sid, tokens, feats, sampling=SamplingParams())
    return len(tokens)


def _host_tree(drafter, sid: str, cfg: TreeParams, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(ranked, "serves", lambda cfg, vocab: False)
        return drafter.draft(sid, cfg)


@pytest.mark.parametrize("kind", ["eagle", "draft-lm"])
@pytest.mark.parametrize("cfg", CASES, ids=lambda c: f"{c.method}-{c.total_tokens}-{c.depth}-{c.expand_k}")
def test_the_device_draft_is_the_host_builders_tree_placed_as_the_verifier_places_it(drafters, kind, cfg,
                                                                                    monkeypatch):
    drafter = drafters[kind]
    for seed in range(3):
        sid = f"ranked-{kind}-{seed}"
        n_tokens = _session(drafter, sid, seed)
        try:
            want = _host_tree(drafter, sid, cfg, monkeypatch)
            got = drafter.draft(sid, cfg)                              # read at once
            assert not isinstance(got, DeviceTree)
            assert_same_tree(got, want)
            assert got.size == ranked.nodes(cfg)
            unread = drafter.draft(sid, cfg, deferred=True)
            assert isinstance(unread, DeviceTree)
            assert_same_tree(unread.materialize(), want)
            placed = place_tree(want, n_tokens - 1, unread.placed.width, "cpu")
            assert unread.placed.n == want.size and torch.equal(unread.placed.packed, placed.packed)
        finally:
            drafter.release(sid)


def test_a_tie_flags_the_draft_and_its_reader_takes_the_level_by_level_one(drafters, monkeypatch):
    """Root log-probs with a tie inside the top-k: the device draft is flagged
    (read at once: None, the host's builder drafts it; unread: the reader's
    fallback), and the tree is the host builder's, ties to the lower token id."""
    drafter, cfg = drafters["eagle"], CASES[0]
    sid = "ranked-tie"
    _session(drafter, sid, 7)
    try:
        sess = drafter.sessions.get(sid)
        hidden, logp = sess.root_out
        tied = logp.clone()
        best = tied.topk(2).indices
        tied[best[1]] = tied[best[0]]                                     # the two best tie
        tied = tied - torch.logsumexp(tied, -1)
        sess.root_out = (hidden, tied)
        want = _host_tree(drafter, sid, cfg, monkeypatch)
        assert want.tokens[1:3].tolist() == sorted(best.tolist())
        unread = drafter.draft(sid, cfg, deferred=True)
        assert isinstance(unread, DeviceTree)
        assert unread.resolve(unread.read.tolist()) is None               # flagged
        assert_same_tree(unread.materialize(), want)
        assert_same_tree(drafter.draft(sid, cfg), want)
    finally:
        drafter.release(sid)
