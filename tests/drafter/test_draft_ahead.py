"""Drafting one round ahead (``Drafter.draft_ahead``): the trees it drafts are
well formed and keyed by outcomes the verifier can actually produce, drafting
them leaves the session exactly as a plain commit would, greedy output never
changes, and with a drafter that predicts the target the next cycle's tree is
ready on nearly every cycle."""

import random

import pytest
import torch

from serving.helpers import drafter_builder, verifier_builder
from specdec.local import generate
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams
from specdec.request.params import TreeParams

CFG = TreeParams(method="eagle2", total_tokens=10, depth=4, expand_k=3)


@pytest.fixture(scope="module")
def engines(tiny_family):
    return {"verifier": verifier_builder(tiny_family)(),
            **{kind: drafter_builder(tiny_family, kind)() for kind in ("eagle", "draft-lm", "oracle", "ngram")},
            "eagle-ref": drafter_builder(tiny_family, "eagle")(),
            "draft-lm-ref": drafter_builder(tiny_family, "draft-lm")()}


class Twin:
    """One session on the drafter under test and the same session on a
    reference drafter (same weights) that only ever commits and drafts."""

    def __init__(self, drafter, reference, seed: int):
        self.d, self.ref = drafter, reference
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.sid = f"twin-{seed}"
        tokens = [self.rng.randrange(drafter.vocab_size) for _ in range(12)]
        feats = self.features(len(tokens) - 1)
        for x in (self.d, self.ref):
            x.prefill(self.sid, tokens, feats, greedy=True)

    def features(self, n: int):
        return torch.randn(n, self.d.hidden_size, generator=self.gen) if self.d.needs_features else None

    def same_draft(self, ahead: bool = False):
        got = self.d.draft(self.sid, CFG, ahead=ahead)
        want = self.ref.draft(self.sid, CFG)
        assert got.tokens.tolist() == want.tokens.tolist()
        assert got.parents.tolist() == want.parents.tolist()
        assert torch.allclose(got.values, want.values, atol=1e-5)
        return got

    def outcome(self, tree) -> list[int]:
        """A random outcome the verifier could commit: a root path plus a bonus
        token that is none of the path end's children."""
        node, path = 0, []
        kids = tree.children()
        while kids[node] and self.rng.random() < 0.7:
            node = self.rng.choice(kids[node])
            path.append(int(tree.tokens[node]))
        taken = {int(tree.tokens[k]) for k in kids[node]}
        bonus = self.rng.choice([t for t in range(self.d.vocab_size) if t not in taken])
        return path + [bonus]


def check_outcomes(tree, trees, cfg=CFG, tokens_left=0):
    """Each (commit, tree) drafted ahead: commit = an accepted root path of
    ``tree`` + a bonus that is not a child there; the tree is rooted at the
    bonus and obeys the knobs and the tokens left."""
    kids = tree.children()
    for commit, ahead in trees:
        node = 0
        for token in commit[:-1]:
            node = next(k for k in kids[node] if int(tree.tokens[k]) == token)   # StopIteration: not a path
        assert commit[-1] not in {int(tree.tokens[k]) for k in kids[node]}
        assert int(ahead.tokens[0]) == commit[-1]
        assert ahead.size <= cfg.total_tokens
        assert int(ahead.depths.max()) <= cfg.depth
        if tokens_left:
            assert int(ahead.depths.max()) <= tokens_left - len(commit) - 1
    assert len({tuple(c) for c, _ in trees}) == len(trees)


@pytest.mark.parametrize("kind", ["eagle", "draft-lm"])
def test_drafting_ahead_leaves_the_session_as_a_commit_would(engines, kind):
    twin = Twin(engines[kind], engines[f"{kind}-ref"], seed=3 if kind == "eagle" else 4)
    tree = twin.same_draft(ahead=True)
    hits = 0
    for cycle in range(8):
        trees = twin.d.draft_ahead(twin.sid, [], None, CFG, count=2)
        assert trees, "a recorded tree always has outcomes to draft for"
        check_outcomes(tree, trees)
        # every other cycle the verifier "commits" an outcome drafted ahead, else a random one
        commit = list(trees[cycle % len(trees)][0]) if cycle % 2 == 0 else twin.outcome(tree)
        feats = twin.features(len(commit))
        ahead = dict((tuple(c), t) for c, t in trees)
        if tuple(commit) in ahead:
            hits += 1
            # the commit travels with the next draft_ahead, which drafts from the tree ahead
            twin.ref.commit(twin.sid, commit, feats)
            nxt = twin.d.draft_ahead(twin.sid, commit, feats, CFG, count=1)
            check_outcomes(ahead[tuple(commit)], nxt)
            tree = twin.same_draft(ahead=True)      # the session is the reference's, bit for bit
        else:
            for x in (twin.d, twin.ref):
                x.commit(twin.sid, commit, feats)
            tree = twin.same_draft(ahead=True)
    assert hits == 4


def test_trees_ahead_stop_at_the_tokens_left(engines):
    twin = Twin(engines["eagle"], engines["eagle-ref"], seed=5)
    tree = twin.same_draft(ahead=True)
    counts = {}
    for left in (1, 2, 3, 4, 6, 0):
        trees = twin.d.draft_ahead(twin.sid, [], None, CFG, count=4, tokens_left=left)
        check_outcomes(tree, trees, tokens_left=left)
        # an outcome that leaves at most one token to generate gets no tree
        assert all(left == 0 or left - len(c) > 1 for c, _ in trees)
        counts[left] = len(trees)
        tree = twin.d.draft(twin.sid, CFG, ahead=True)          # the same tree, recorded again
    # the shortest outcome commits 1 token: nothing is left to draft for below 3 tokens
    assert counts[1] == counts[2] == 0
    assert 0 < counts[6] <= counts[0]


def test_no_tree_ahead_without_a_recorded_tree(engines):
    twin = Twin(engines["eagle"], engines["eagle-ref"], seed=6)
    twin.same_draft(ahead=False)                             # not recorded
    assert twin.d.draft_ahead(twin.sid, [], None, CFG, count=2) == []
    tree = twin.same_draft(ahead=True)
    commit = twin.outcome(tree)
    feats = twin.features(len(commit))
    # tokens that match no outcome drafted ahead: committed, nothing drafted from a stale tree
    assert twin.d.draft_ahead(twin.sid, commit, feats, CFG, count=2) == []
    twin.ref.commit(twin.sid, commit, feats)
    twin.same_draft()
    ngram = engines["ngram"]
    ngram.prefill("n", [1, 2, 3, 1, 2])
    assert not ngram.drafts_ahead
    ngram.draft("n", CFG, ahead=True)
    assert ngram.draft_ahead("n", [3], None, CFG, count=2) == []
    assert ngram.sessions.get("n").tokens[-1] == 3


@pytest.mark.parametrize("kind", ["eagle", "draft-lm", "oracle"])
def test_greedy_output_is_unchanged(engines, tiny_family, kind):
    from specdec.model.loading import load_tokenizer

    tok = load_tokenizer(tiny_family["target"])
    stop = StopCriteria(max_new_tokens=40)
    for prompt in ("def add(a, b):", "for i in range(3):\n"):
        ids = tok(prompt, add_special_tokens=True)["input_ids"]
        plain = generate(engines["verifier"], None, ids, SamplingParams(), stop, None)
        # The random tiny target is unsure (flat distributions), so an eagle2 tree of it stays
        # shallow; a chain of the oracle's greedy drafts is accepted whole, and a sharp value
        # temperature (what calibration fits for greedy acceptance) makes its values say so.
        cfg = (TreeParams(method="chain", total_tokens=6, depth=5, value_temperature=0.05) if kind == "oracle"
               else CFG)
        for lookahead in (1, 3):
            dec = generate(engines["verifier"], engines[kind], ids, SamplingParams(), stop, cfg,
                           lookahead=lookahead)
            assert dec.tokens == plain.tokens
            if kind == "oracle":
                # Its greedy path is the target's, so the accepted path is always its likeliest
                # one but where the random target nearly ties: with three paths drafted ahead,
                # every cycle after the first (drafted plainly) finds its tree ready.
                assert dec.stats.tau > 5.0
                assert dec.stats.ahead_hits >= (dec.stats.cycles - 1 if lookahead == 3 else 3), \
                    dec.stats.as_dict()


def test_tempered_tops_are_each_rows_own_top_tokens():
    """One top-k over the rows gives each row what it alone would: its k likeliest
    tokens at the temperature, its excluded tokens kept out and the rest
    renormalised, -inf ones dropped."""
    from drafter.ahead import tempered_tops

    gen = torch.Generator().manual_seed(3)
    logp = torch.log_softmax(torch.randn(4, 50, generator=gen), dim=-1)
    logp[2, 5:] = -float("inf")                            # row 2 has five tokens only
    exclude = [[7, 1], [], [0, 3, 4], [int(logp[3].argmax())]]
    got = tempered_tops(logp, 4, 0.7, exclude)
    for row in range(4):
        x = logp[row] / 0.7
        x[exclude[row]] = -float("inf")
        x = x - torch.logsumexp(x, dim=-1)
        order = [t for t in torch.sort(x, descending=True, stable=True).indices.tolist()
                 if x[t] > -float("inf")][:4]
        assert [t for _, t in got[row]] == order
        assert [p for p, _ in got[row]] == pytest.approx([float(x[t]) for t in order], abs=1e-5)
    assert len(got[2]) == 2                                # 1 and 2 of its five tokens are left


def test_stop_scores_follow_their_definition():
    """log P(stop at i) = value_i + log(1 - sum over i's children c of exp(value_c - value_i))."""
    from drafter.ahead import stop_scores
    from specdec.tree.layout import DraftTree

    parents = [-1, 0, 0, 1, 1, 2]
    values = torch.tensor([0.0, -0.2, -1.9, -0.9, -1.2, -2.5])
    tree = DraftTree(torch.arange(6), torch.tensor(parents), torch.tensor([0, 1, 1, 2, 2, 2]), values)
    want = []
    for i in range(6):
        kids = [c for c in range(6) if parents[c] == i]
        stay = 1.0 - sum(torch.exp(values[c] - values[i]).item() for c in kids)
        want.append(values[i].item() + torch.log(torch.tensor(max(stay, 1e-12))).item())
    assert stop_scores(tree).tolist() == pytest.approx(want, abs=1e-5)
