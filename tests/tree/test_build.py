"""Tests for specdec.tree.build: EAGLE-2 Figure 7, builder properties, baselines, validation."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.request.params import METHODS, TreeParams
from specdec.request.tree_shapes import check_shape, default_static_shape
from specdec.tree.build import DraftTree, Frontier, TreeError, build_tree, validate_tree

# ---------------------------------------------------------------- helpers


def log_dist(vocab: int, top: dict[int, float]) -> torch.Tensor:
    """Log of a distribution over vocab with the given probabilities on `top` and
    the rest of the mass spread evenly over the other tokens. -> [V] fp32"""
    rest = (1.0 - sum(top.values())) / (vocab - len(top))
    p = torch.full((vocab,), rest, dtype=torch.float64)
    for tok, q in top.items():
        p[tok] = q
    return p.log().float()


class PathDraft:
    """An expand fn whose next-token log-probs depend on the token path of each
    frontier node; it records the frontiers and the log-probs it handed out."""

    def __init__(self, root: int, next_logp):
        self.root = root
        self.next_logp = next_logp  # token path tuple -> [V] log-probs
        self.path_of: dict[int, tuple[int, ...]] = {}  # pool id -> token path
        self.logp: dict[tuple[int, ...], torch.Tensor] = {}
        self.calls: list[Frontier] = []

    def __call__(self, f: Frontier) -> torch.Tensor:
        assert f.nodes.dtype == f.tokens.dtype == f.parents.dtype == torch.int64
        assert len(f.nodes) == len(f.tokens) == len(f.parents) >= 1
        rows = []
        for node, tok, par in zip(f.nodes.tolist(), f.tokens.tolist(), f.parents.tolist()):
            if par == -1:
                assert (node, tok, f.depth) == (0, self.root, 0)
                path = (tok,)
            else:
                # the parent must have been expanded before, one level up
                assert len(self.path_of[par]) == f.depth
                path = self.path_of[par] + (tok,)
            self.path_of[node] = path
            self.logp[path] = self.next_logp(path)
            rows.append(self.logp[path])
        self.calls.append(f)
        return torch.stack(rows)

    def node_logp(self, path: tuple[int, ...]) -> torch.Tensor:
        """fp32 log-prob of the last token of path given the rest."""
        return self.logp[path[:-1]][path[-1]]

    def path_value(self, path: tuple[int, ...]) -> torch.Tensor:
        value = torch.zeros((), dtype=torch.float32)
        for i in range(2, len(path) + 1):
            value = value + self.node_logp(path[:i])
        return value


def token_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    tokens, parents = tree.to_lists()
    out: list[tuple[int, ...]] = []
    for i, (t, p) in enumerate(zip(tokens, parents)):
        out.append((t,) if p == -1 else out[p] + (t,))
    return out


def brute_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            mask[i, j] = True
            j = parents[j]
    return mask


# ---------------------------------------------------------------- Figure 7

WORDS = ["It", "is", "has", "a", "the", "to", "good", "nice", "be", "do"]
W = {w: i for i, w in enumerate(WORDS)}
FIG7 = {  # last token of the expanded node -> its two most confident next tokens
    "It": {"is": 0.6, "has": 0.2},
    "is": {"a": 0.8, "the": 0.1},
    "has": {"to": 0.7, "a": 0.1},
    "a": {"good": 0.7, "nice": 0.1},
    "to": {"be": 0.6, "do": 0.2},
}


def fig7_draft() -> PathDraft:
    def next_logp(path):
        top = FIG7[WORDS[path[-1]]]
        return log_dist(len(WORDS), {W[w]: q for w, q in top.items()})

    return PathDraft(W["It"], next_logp)


def test_figure7_tree():
    draft = fig7_draft()
    tree = build_tree(W["It"], draft, TreeParams("eagle2", total_tokens=8, depth=3, expand_k=2))
    assert [WORDS[t] for t in tree.tokens.tolist()] == "It is has a the to good be".split()
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3, 5]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 3, 3]
    assert tree.values.dtype == torch.float32
    expected = torch.tensor([1.0, 0.6, 0.2, 0.48, 0.06, 0.14, 0.336, 0.084]).log()
    torch.testing.assert_close(tree.values, expected, rtol=0, atol=1e-5)
    figure = [  # the figure's attention mask: row i sees i and its ancestors
        "x.......",
        "xx......",
        "x.x.....",
        "xx.x....",
        "xx..x...",
        "x.x..x..",
        "xx.x..x.",
        "x.x..x.x",
    ]
    assert torch.equal(tree.ancestor_mask(), torch.tensor([[c == "x" for c in row] for row in figure]))
    assert tree.paths() == [[0, 1, 4], [0, 1, 3, 6], [0, 2, 5, 7]]  # leaves the, good, be
    assert tree.children() == [[1, 2], [3, 4], [5], [6], [], [7], [], []]
    assert tree.position_ids(10).tolist() == [10, 11, 11, 12, 12, 12, 13, 13]
    assert tree.expected_accepted() == pytest.approx(0.6 + 0.2 + 0.48 + 0.06 + 0.14 + 0.336 + 0.084, rel=1e-5)
    words = "It is has a the to good be".split()
    assert tree.to_lists() == ([W[w] for w in words], [-1, 0, 0, 1, 1, 2, 3, 5])


def test_figure7_frontiers():
    draft = fig7_draft()
    build_tree(W["It"], draft, TreeParams("eagle2", total_tokens=8, depth=3, expand_k=2))
    seen = [(f.nodes.tolist(), [WORDS[t] for t in f.tokens.tolist()], f.parents.tolist(), f.depth)
            for f in draft.calls]
    # pool ids: 1 is, 2 has | 3 is>a, 4 is>the, 5 has>to, 6 has>a | 7.. level 3
    assert seen == [
        ([0], ["It"], [-1], 0),
        ([1, 2], ["is", "has"], [0, 0], 1),
        ([3, 5], ["a", "to"], [1, 2], 2),
    ]


def test_figure7_no_rerank_keeps_the_frontiers():
    draft = fig7_draft()
    tree = build_tree(W["It"], draft, TreeParams("no-rerank", total_tokens=8, depth=3, expand_k=2))
    # level 3's best two by value are a>good (.336) and to>be (.084)
    assert [WORDS[t] for t in tree.tokens.tolist()] == "It is has a to good be".split()
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2, 3, 4]


# ---------------------------------------------------------------- crafted cases


def test_no_value_expands_by_local_confidence():
    # A .6 -> a1 .5 (.30), a2 .45 (.27); B .3 -> b1 .6 (.18), b2 .35 (.105)
    table = {0: {1: 0.6, 2: 0.3}, 1: {3: 0.5, 4: 0.45}, 2: {5: 0.6, 6: 0.35}}
    fronts = {}
    for method in ("eagle2", "no-value"):
        draft = PathDraft(0, lambda path: log_dist(12, table.get(path[-1], {7: 0.5, 8: 0.4})))
        build_tree(0, draft, TreeParams(method, total_tokens=20, depth=3, expand_k=2))
        fronts[method] = draft.calls[2].tokens.tolist()
    assert fronts["eagle2"] == [3, 4]  # highest values, both under A
    assert fronts["no-value"] == [3, 5]  # highest own confidence: a1 (.5), b1 (.6)


def test_rerank_breaks_value_ties_by_depth():
    # root -> 1, 2 (p = .5 each); then token 3 with p = 1 - 1e-13: in fp32 every
    # node on those paths has the same value, log .5, down to depth 3
    def next_logp(path):
        logits = torch.full((6,), -math.inf)
        if path[-1] == 0:
            logits[1] = logits[2] = 0.0
        else:
            logits[3], logits[4] = 0.0, -30.0
        return logits.log_softmax(-1)

    tree = build_tree(0, PathDraft(0, next_logp), TreeParams(total_tokens=4, depth=6, expand_k=2))
    assert torch.equal(tree.values[1:], torch.full((3,), math.log(0.5)))  # a real tie
    assert tree.tokens.tolist() == [0, 1, 2, 3] and tree.parents.tolist() == [-1, 0, 0, 1]
    tree = build_tree(0, PathDraft(0, next_logp), TreeParams(total_tokens=6, depth=6, expand_k=2))
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2, 3]
    assert torch.equal(tree.values[1:], torch.full((5,), math.log(0.5)))


def test_top_children_ties_go_to_lower_ids():
    # one possible token, the rest tied at -inf: the k-th place is a tie
    def next_logp(path):
        logits = torch.full((8,), -math.inf)
        logits[5] = 0.0
        return logits.log_softmax(-1)

    tree = build_tree(7, PathDraft(7, next_logp), TreeParams(total_tokens=4, depth=1, expand_k=3))
    assert tree.tokens.tolist() == [7, 5, 0, 1]


def test_deterministic():
    def make():
        gen = torch.Generator().manual_seed(3)
        return PathDraft(0, lambda path: torch.randn(30, generator=gen).log_softmax(-1))

    cfg = TreeParams(total_tokens=20, depth=4, expand_k=3)
    a, b = build_tree(0, make(), cfg), build_tree(0, make(), cfg)
    for name in ("tokens", "parents", "depths", "values"):
        assert torch.equal(getattr(a, name), getattr(b, name))


def test_chain_is_the_greedy_path():
    gen = torch.Generator().manual_seed(0)
    draft = PathDraft(2, lambda path: torch.randn(20, generator=gen).log_softmax(-1))
    tree = build_tree(2, draft, TreeParams("chain", total_tokens=4, depth=6, expand_k=5))
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    paths = token_paths(tree)
    for i in range(1, 4):
        assert paths[i][-1] == int(draft.logp[paths[i - 1]].argmax())
    assert [len(f.nodes) for f in draft.calls] == [1, 1, 1]


def ranked(path):  # token r is the rank-r choice everywhere
    return (-torch.arange(16, dtype=torch.float32)).log_softmax(-1)


def test_static_follows_the_shape():
    shape = ((0,), (2,), (0, 0), (0, 1), (2, 3), (0, 1, 0))
    draft = PathDraft(9, ranked)
    tree = build_tree(9, draft, TreeParams("static", total_tokens=50, depth=5, static_shape=shape))
    assert tree.tokens.tolist() == [9, 0, 2, 0, 1, 3, 0]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 4]
    # frontier at each level: the shape nodes there that have children
    assert [f.nodes.tolist() for f in draft.calls] == [[0], [1, 2], [4]]
    # cut to total_tokens and depth: still a prefix-closed tree
    cut = build_tree(9, PathDraft(9, ranked), TreeParams("static", total_tokens=4, static_shape=shape))
    assert cut.tokens.tolist() == [9, 0, 2, 0] and cut.parents.tolist() == [-1, 0, 0, 1]
    flat = build_tree(9, PathDraft(9, ranked), TreeParams("static", depth=1, static_shape=shape))
    assert flat.tokens.tolist() == [9, 0, 2]


def test_static_skips_ranks_beyond_the_vocabulary():
    shape = ((0,), (5,), (5, 0), (0, 0))
    small = PathDraft(0, lambda path: (-torch.arange(3, dtype=torch.float32)).log_softmax(-1))
    tree = build_tree(0, small, TreeParams("static", total_tokens=10, static_shape=shape))
    assert tree.tokens.tolist() == [0, 0, 0] and tree.parents.tolist() == [-1, 0, 1]


def test_default_static_shape():
    shape = default_static_shape()
    check_shape(shape)  # distinct, parents first
    assert len(shape) == 59 and max(map(len, shape)) <= 6
    assert shape[:4] == ((0,), (0, 0), (0, 0, 0), (1,))
    tree = build_tree(0, PathDraft(0, ranked), TreeParams("static", total_tokens=60, depth=6))
    assert tree.size == 60
    tree = build_tree(0, PathDraft(0, ranked), TreeParams("static", total_tokens=10, depth=6))
    assert tree.size == 10


def test_expand_output_is_checked():
    with pytest.raises(ValueError, match="shape"):
        build_tree(0, lambda f: torch.zeros(3, 5), TreeParams())
    with pytest.raises(ValueError, match="NaN"):
        build_tree(0, lambda f: torch.full((len(f.nodes), 5), math.nan), TreeParams())
    with pytest.raises(ValueError, match="log-prob"):
        build_tree(0, lambda f: torch.randn(len(f.nodes), 5) + 5, TreeParams())
    with pytest.raises(TreeError, match="root_token"):
        build_tree(-1, lambda f: torch.zeros(len(f.nodes), 5), TreeParams())


@pytest.mark.parametrize("kwargs, field", [
    ({"method": "beam"}, "method"),
    ({"total_tokens": 0}, "total_tokens"),
    ({"depth": 0}, "depth"),
    ({"expand_k": 0}, "expand_k"),
    ({"expand_k": 2.5}, "expand_k"),
    ({"static_shape": ((0, 0),)}, "static_shape"),
    ({"static_shape": ((0,), (-1,))}, "static_shape"),
    ({"static_shape": ((0,), (0,))}, "static_shape"),
    ({"static_shape": ()}, "static_shape"),
    ({"value_temperature": 0}, "value_temperature"),
    ({"value_temperature": -0.5}, "value_temperature"),
    ({"value_temperature": math.inf}, "value_temperature"),
    ({"value_temperature": True}, "value_temperature"),
])
def test_config_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TreeParams(**kwargs)


def test_value_temperature_sharpens_values_and_deepens_the_tree():
    """Values are sums of log softmax(logits / t): the same candidates in the
    same order per row, but a confident token's path outranks wide siblings."""
    vocab = 8

    def next_logp(path):                  # token 1 always at 0.5, token 2 at 0.3
        return log_dist(vocab, {1: 0.5, 2: 0.3})

    base = TreeParams(method="eagle2", total_tokens=5, depth=4, expand_k=2)
    plain = build_tree(0, PathDraft(0, next_logp), base)
    draft = PathDraft(0, next_logp)
    sharp = build_tree(0, draft, TreeParams(method="eagle2", total_tokens=5, depth=4, expand_k=2,
                                            value_temperature=0.25))
    assert max(plain.depths.tolist()) == 2          # 0.5 * 0.5 < 0.3: the runner-up joins first
    assert sharp.depths.tolist() == [0, 1, 2, 3, 4]   # sharpened: the top path all the way down
    scaled = torch.log_softmax(log_dist(vocab, {1: 0.5, 2: 0.3}).double() / 0.25, -1)
    for i in range(1, sharp.size):
        assert sharp.values[i].item() == pytest.approx(i * scaled[1].item(), rel=1e-5)
    assert build_tree(0, PathDraft(0, next_logp), replace(base, value_temperature=1.0)).values.equal(plain.values)


def test_config_accepts_list_shape():
    assert TreeParams(static_shape=[[0], [0, 1]]).static_shape == ((0,), (0, 1))


# ---------------------------------------------------------------- properties


@st.composite
def drafts(draw):
    """(vocab, next_logp): random draft distributions, fresh per expanded node."""
    vocab = draw(st.integers(5, 50))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([0.3, 1.0, 4.0]))
    masked = draw(st.booleans())  # a top-k filtered draft: most tokens impossible
    gen = torch.Generator().manual_seed(seed)

    def next_logp(path):
        logits = torch.randn(vocab, generator=gen) * scale
        if masked:
            logits[torch.rand(vocab, generator=gen) < 0.7] = -math.inf
            logits[int(torch.randint(vocab, (1,), generator=gen))] = 0.0
        return logits.log_softmax(-1)

    return vocab, next_logp


configs = st.builds(
    TreeParams,
    method=st.sampled_from(METHODS),
    total_tokens=st.integers(1, 40),
    depth=st.integers(1, 6),
    expand_k=st.integers(1, 6),
)


def check_layout(tree: DraftTree, draft: PathDraft, cfg: TreeParams, vocab: int):
    n = tree.size
    tokens, parents = tree.to_lists()
    depths = tree.depths.tolist()
    validate_tree(tokens, parents, vocab)  # connected and topological: 0 <= parents[i] < i
    assert 1 <= n <= cfg.total_tokens and tokens[0] == draft.root
    assert all(depths[i] == depths[parents[i]] + 1 for i in range(1, n))
    assert depths == sorted(depths) and max(depths) <= cfg.depth
    assert tree.position_ids(7).tolist() == [7 + d for d in depths]
    kids = tree.children()
    assert all(len({tokens[c] for c in cs}) == len(cs) for cs in kids)  # siblings differ
    # values: the exact fp32 sum of the draft log-probs on the path, never growing
    paths = token_paths(tree)
    assert tree.values[0].item() == 0.0
    for i in range(1, n):
        assert torch.equal(tree.values[i], draft.path_value(paths[i]))
        assert tree.values[i] <= tree.values[parents[i]]
    assert torch.equal(tree.ancestor_mask(), brute_mask(parents))
    leaves = [i for i in range(n) if not kids[i]]
    assert [p[-1] for p in tree.paths()] == leaves
    for p in tree.paths():
        assert p[0] == 0 and all(parents[b] == a for a, b in zip(p, p[1:]))
    assert tree.expected_accepted() == pytest.approx(float(tree.values[1:].exp().sum()))


def ranking(lp: torch.Tensor) -> list[int]:
    """Reference token ranking: log-prob desc, then token id asc."""
    return torch.sort(lp, descending=True, stable=True).indices.tolist()


def children_of(draft: PathDraft, path_list, kk: int):
    """Token paths of the top-kk children of each path, best first."""
    return [p + (t,) for p in path_list for t in ranking(draft.logp[p])[:kk]]


def check_dynamic(tree: DraftTree, draft: PathDraft, cfg: TreeParams, vocab: int):
    n = tree.size
    levels = min(cfg.depth, cfg.total_tokens - 1)
    k = 1 if cfg.method == "chain" else cfg.expand_k
    kk = min(k, vocab)
    calls = draft.calls
    assert [f.depth for f in calls] == list(range(levels))

    def key(path):  # what picks the next frontier
        return draft.node_logp(path).item() if cfg.method == "no-value" else draft.path_value(path).item()

    def pick(made):  # positions of the best k by key, ties to the earlier one
        return sorted(sorted(range(len(made)), key=lambda i: (-key(made[i]), i))[:k])

    # children are created frontier node by frontier node, best first, and pool ids
    # count them in that order; each frontier is the best k of the previous level
    levels_made = [children_of(draft, [draft.path_of[i] for i in f.nodes.tolist()], kk) for f in calls]
    offset = 1
    for made, f in zip(levels_made, calls[1:]):
        assert f.nodes.tolist() == [offset + i for i in pick(made)]
        assert [draft.path_of[i] for i in f.nodes.tolist()] == [made[i] for i in pick(made)]
        offset += len(made)

    pool = [p for made in levels_made for p in made]
    if vocab >= k and levels >= 1 and cfg.method != "chain":
        assert len(pool) == k + (levels - 1) * k * k
    tokens, parents = tree.to_lists()
    depths = tree.depths.tolist()
    kept = sorted((v.item() for v in tree.values[1:]), reverse=True)
    every = sorted((draft.path_value(p).item() for p in pool), reverse=True)

    if cfg.method in ("eagle2", "no-value"):
        assert n == min(cfg.total_tokens, 1 + len(pool))
        # rerank keeps the best: no candidate left out beats the worst kept one
        assert kept == every[: n - 1]
        assert all(v <= kept[-1] for v in every[n - 1:])
    if cfg.method == "no-rerank":
        # the draft is each level's frontier in pool-id order: the expanded ones,
        # then the best k of the last level's children
        fronts = [t for f in calls[1:] for t in f.tokens.tolist()]
        if levels:
            fronts += [levels_made[-1][i][-1] for i in pick(levels_made[-1])]
        assert tokens == [draft.root] + fronts[: cfg.total_tokens - 1]
    if cfg.method == "chain":
        assert parents == list(range(-1, n - 1)) and n == min(cfg.total_tokens, 1 + cfg.depth)
        paths = token_paths(tree)
        assert all(paths[i][-1] == ranking(draft.logp[paths[i - 1]])[0] for i in range(1, n))


def check_static(tree: DraftTree, draft: PathDraft, cfg: TreeParams, vocab: int):
    shape = [p for p in default_static_shape() if len(p) <= cfg.depth][: cfg.total_tokens - 1]
    wanted = {p for p in shape if max(p) < vocab}
    assert tree.size == 1 + len(wanted)
    ranks: list[tuple[int, ...]] = [()]
    for path, parent in zip(token_paths(tree)[1:], tree.parents.tolist()[1:]):
        ranks.append(ranks[parent] + (ranking(draft.logp[path[:-1]]).index(path[-1]),))
    assert set(ranks[1:]) == wanted


@settings(max_examples=150, deadline=None)
@given(drafts(), configs, st.integers(0, 49))
def test_tree_properties(draft_spec, cfg, root):
    vocab, next_logp = draft_spec
    draft = PathDraft(root % vocab, next_logp)
    tree = build_tree(root % vocab, draft, cfg)
    check_layout(tree, draft, cfg, vocab)
    if cfg.method == "static":
        check_static(tree, draft, cfg, vocab)
    else:
        check_dynamic(tree, draft, cfg, vocab)


def test_the_floored_logsumexp_is_torchs_in_float32():
    """Terms that would underflow are floored (the CPU's exp is slow there), which
    must not change a float32 result: a reduced vocabulary's -inf entries, a low
    value temperature's spread, and rows that are all -inf, hold +inf or NaN."""
    from specdec.tree.build import logsumexp

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4096, generator=gen) * 8
    x[1, 1024:] = -math.inf                     # a reduced draft vocabulary
    x[2] = x[2] / 0.05                          # a low temperature: most terms below exp's range
    x[3] = -math.inf
    x[4, 17] = math.inf
    x[5, 3] = math.nan
    torch.testing.assert_close(logsumexp(x), torch.logsumexp(x, dim=-1, keepdim=True), rtol=0, atol=1e-6,
                               equal_nan=True)
