"""Top-token trees drafted on the device (``specdec.tree.ranked``): for every
method it serves, an eager head's and a draft LM's, the tree is the one the
host's level-by-level builder drafts from the same log-probs, values
included, and left unread it is placed as the verifier places it; ties in a
level's top-k are decided there as the host decides them, and one it cannot
decide flags the draft, whose reader takes the level-by-level one."""

from dataclasses import replace

import pytest
import torch
from trees import assert_same_tree

from specdec.model.loading import ModelSpec
from specdec.request.params import SamplingParams, TreeParams
from specdec.tree import build, ranked
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


def _tie_root(drafter, sid: str, n: int) -> list[int]:
    """Tie the session's n best root log-probs (renormalised); returns their ids, ascending."""
    sess = drafter.sessions.get(sid)
    hidden, logp = sess.root_out
    tied = logp.clone()
    best = tied.topk(n).indices
    tied[best] = float(tied[best[0]])
    sess.root_out = (hidden, tied - torch.logsumexp(tied, -1))
    return sorted(best.tolist())


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


@pytest.mark.parametrize("k", [1, 3, 10])
def test_the_untied_top_k_ranks_as_the_host_builder_does(k):
    """Half-precision log-probs tie often: wherever ``top_untied`` calls its
    ranking exact it is ``_top_tokens``'s (best first, ties to the lower id),
    and it is inexact only where the tokens at or above the k-th place fill
    its 2k candidates (one more might tie)."""
    gen = torch.Generator().manual_seed(k)
    exact = 0
    for coarse in (8.0, 2.0, 0.5):                                 # steps of the logits: ties from rare to many
        logits = torch.round(torch.randn(64, 300, generator=gen) * 4 / coarse) * coarse
        logp = torch.log_softmax(logits, -1).to(torch.bfloat16)
        lp, tok, ok = ranked.top_untied(logp, k)
        rows_ok = [bool(ranked.top_untied(logp[r:r + 1], k)[2]) for r in range(logp.shape[0])]
        assert bool(ok) == all(rows_ok)                            # the batch is exact where every row is
        for row, row_ok in enumerate(rows_ok):
            kth = logp[row].float().topk(k).values[-1]
            assert row_ok == (int((logp[row].float() >= kth).sum()) < 2 * k)
            if row_ok:
                exact += 1
                want_lp, want_tok = build._top_tokens(logp[row:row + 1], k)
                assert tok[row].tolist() == want_tok[0].tolist() and torch.equal(lp[row], want_lp[0])
    assert exact > 64                                              # (most rows are decided on the device)


def test_a_tie_in_the_top_k_is_decided_on_the_device_as_the_host_builder_decides_it(drafters, monkeypatch):
    """Root log-probs whose two best tie: the device draft is not flagged and is
    the host builder's tree, the lower token id first."""
    drafter, cfg = drafters["eagle"], CASES[0]
    sid = "ranked-tie"
    _session(drafter, sid, 7)
    try:
        best = _tie_root(drafter, sid, 2)                                 # the two best tie
        want = _host_tree(drafter, sid, cfg, monkeypatch)
        assert want.tokens[1:3].tolist() == best
        unread = drafter.draft(sid, cfg, deferred=True)
        assert isinstance(unread, DeviceTree)
        assert_same_tree(unread.resolve(unread.read.tolist()), want)      # not flagged
        assert_same_tree(drafter.draft(sid, cfg), want)
    finally:
        drafter.release(sid)


def test_a_tie_past_the_candidates_flags_the_draft_and_its_reader_takes_the_level_by_level_one(drafters,
                                                                                              monkeypatch):
    """Root log-probs where more tokens tie at the k-th place than the device
    ranks (2k candidates): the draft is flagged (read at once: the host's
    builder drafts it; unread: the reader's fallback), and the tree is the host
    builder's, ties to the lower token id."""
    drafter, cfg = drafters["eagle"], CASES[0]
    sid = "ranked-tie-wide"
    _session(drafter, sid, 7)
    try:
        many = _tie_root(drafter, sid, 3 * cfg.expand_k)                  # 3k tokens tie for the best
        want = _host_tree(drafter, sid, cfg, monkeypatch)
        assert want.tokens[1:1 + cfg.expand_k].tolist() == many[:cfg.expand_k]
        unread = drafter.draft(sid, cfg, deferred=True)
        assert isinstance(unread, DeviceTree)
        assert unread.resolve(unread.read.tolist()) is None               # flagged
        assert_same_tree(unread.materialize(), want)
        assert_same_tree(drafter.draft(sid, cfg), want)
    finally:
        drafter.release(sid)
