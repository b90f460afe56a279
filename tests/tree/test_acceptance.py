"""Greedy and sampling acceptance on draft trees; losslessness checked statistically."""

from collections import Counter
from functools import partial

import pytest
import torch

from specdec.request.params import SamplingParams
from specdec.tree.acceptance import Acceptance, accept, accept_greedy, accept_sampling
from specdec.tree.build import DraftTree, tree_from_lists
from specdec.tree.sampling import make_generator, target_probs
from stats import chi2_pvalue

P_MIN = 1e-4  # chi-square p-value below which a distribution check fails


# ---------------------------------------------------------------- greedy

#        0 (9)
#       /     \
#    1 (1)   2 (2)
#    /   \
#  3 (3) 4 (4)
#   |
#  5 (5)
GREEDY_TREE = ([9, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 3])


@pytest.mark.parametrize(
    "argmax,accepted,bonus",
    [
        ([1, 3, 0, 5, 0, 7], [1, 3, 5], 7),  # the whole deepest path
        ([1, 4, 0, 5, 6, 0], [1, 4], 6),  # second child of node 1
        ([1, 8, 0, 5, 0, 0], [1], 8),  # stops below node 1
        ([2, 3, 11, 5, 0, 0], [2], 11),  # second child of the root, a leaf
        ([8, 3, 0, 5, 0, 0], [], 8),  # nothing accepted: bonus = argmax at root
    ],
)
def test_greedy_paths(argmax, accepted, bonus):
    tree = tree_from_lists(*GREEDY_TREE)
    got = accept_greedy(tree, torch.tensor(argmax))
    assert got == Acceptance(accepted=accepted, bonus=bonus)
    assert got.tokens(tree) == [GREEDY_TREE[0][i] for i in accepted] + [bonus]


def test_greedy_takes_first_matching_sibling():
    # Nodes 1 and 2 both carry token 7; only node 2 has a matching child, but
    # the walk commits to node 1 (index order) and stops there.
    tree = tree_from_lists([0, 7, 7, 3], [-1, 0, 0, 2])
    got = accept_greedy(tree, torch.tensor([7, 5, 3, 1]))
    assert got == Acceptance(accepted=[1], bonus=5)


def test_greedy_root_only_tree():
    tree = tree_from_lists([4], [-1])
    assert accept_greedy(tree, torch.tensor([6])) == Acceptance(accepted=[], bonus=6)


def test_shape_mismatch_raises():
    tree = tree_from_lists(*GREEDY_TREE)
    with pytest.raises(ValueError):
        accept_greedy(tree, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError):
        accept_sampling(tree, torch.full((5, 4), 0.25), make_generator(0))


def _random_tree(rng: torch.Generator, n: int, vocab: int) -> DraftTree:
    parents = [-1] + [int(torch.randint(0, i, (), generator=rng)) for i in range(1, n)]
    tokens = torch.randint(0, vocab, (n,), generator=rng).tolist()
    return tree_from_lists(tokens, parents)


def test_sampling_with_one_hot_targets_is_greedy():
    rng = torch.Generator().manual_seed(0)
    g = make_generator(0)
    for _ in range(200):
        vocab = 4
        tree = _random_tree(rng, int(torch.randint(1, 12, (), generator=rng)), vocab)
        argmax = torch.randint(0, vocab, (tree.tokens.shape[0],), generator=rng)
        one_hot = torch.nn.functional.one_hot(argmax, vocab).float()
        assert accept_sampling(tree, one_hot, g) == accept_greedy(tree, argmax)


def test_draft_equal_to_target_accepts_everything():
    chain = tree_from_lists([0, 1, 2, 3, 4], [-1, 0, 1, 2, 3])
    probs = torch.nn.functional.one_hot(torch.tensor([1, 2, 3, 4, 5]), 6).float()
    g = make_generator(1)
    for _ in range(20):
        got = accept_sampling(chain, probs, g)
        assert got == Acceptance(accepted=[1, 2, 3, 4], bonus=5)


# ---------------------------------------------------------------- sampling

VOCAB = 6
#               0 (5)
#     /      /        \         \
#  1 (2)   2 (4)p=0   3 (2)dup  4 (0)
#   /   \                         |
# 5 (1) 6 (3)p=0                 7 (1)
#  /  \      |
# 8(0) 9(0)dup 10 (5)
SAMPLING_TREE = tree_from_lists(
    [5, 2, 4, 2, 0, 1, 3, 1, 0, 0, 5],
    [-1, 0, 0, 0, 0, 1, 1, 4, 5, 5, 6],
)


def _tree_logits(seed: int) -> torch.Tensor:
    """Random target logits [n, V] at every node of SAMPLING_TREE. Each draft
    token gets +1 under its parent, as a useful drafter would, so that deep
    nodes are reached often enough to be tested."""
    g = torch.Generator().manual_seed(seed)
    n = SAMPLING_TREE.tokens.shape[0]
    logits = torch.randn(n, VOCAB, generator=g)
    logits[SAMPLING_TREE.parents[1:], SAMPLING_TREE.tokens[1:]] += 1.0
    logits[0, 4] = float("-inf")  # node 2's token is impossible at the root
    logits[1, 3] = float("-inf")  # node 6's token is impossible at node 1
    return logits


def _reference_accept(tree, probs, generator, variant: str = "exact") -> Acceptance:
    """The contract read literally, on tensors; `variant` plants known bugs.

    exact:     accept x with prob p[x] / p.sum(); on reject p[x] = 0.
    no_zero:   rejected tokens stay in the residual.
    no_renorm: rejected tokens are zeroed, but later siblings are accepted
               with prob p[x] / (original mass), as if nothing was removed.
    stale_bonus: siblings are tried correctly, but the bonus is drawn from
               the target row instead of the residual.
    """
    children = tree.children()
    tokens = tree.tokens.tolist()
    # one uniform per node, drawn up front, used when the walk tries that node (``accept_sampling`` tests
    # every node at once); a root-only tree draws none
    uniforms = torch.rand(len(tokens), generator=generator).tolist() if len(tokens) > 1 else []
    accepted, node = [], 0
    while True:
        p = probs[node].clone()
        full_mass = float(p.sum(dtype=torch.float64))
        nxt = None
        for child in children[node]:
            x = tokens[child]
            mass = full_mass if variant == "no_renorm" else float(p.sum(dtype=torch.float64))
            ratio = float(p[x]) / mass
            if uniforms[child] < ratio:
                nxt = child
                break
            if variant != "no_zero":
                p[x] = 0.0
        if nxt is None:
            bonus_from = probs[node] if variant == "stale_bonus" else p
            return Acceptance(accepted, int(torch.multinomial(bonus_from, 1, generator=generator)))
        accepted.append(nxt)
        node = nxt


def _first_child_with_token(tree, children, node: int) -> dict[int, int]:
    # Which node a committed token leads to: the first child carrying it.
    out: dict[int, int] = {}
    for c in children[node]:
        out.setdefault(int(tree.tokens[c]), c)
    return out


def _sequence_probs(tree, probs) -> dict[tuple[int, ...], float]:
    """Target probability of every possible committed sequence: the tokens of
    a reachable node's path, then a bonus token that leads out of the tree."""
    children = tree.children()
    p = probs.double()
    out: dict[tuple[int, ...], float] = {}
    stack = [(0, (), 1.0)]
    while stack:
        node, path, mass = stack.pop()
        row = p[node] / p[node].sum()
        step = _first_child_with_token(tree, children, node)
        for x in range(row.shape[0]):
            if x in step:
                stack.append((step[x], path + (x,), mass * float(row[x])))
            else:
                out[path + (x,)] = mass * float(row[x])
    return out


def _lossless_pvalues(accept_fn, probs: torch.Tensor, n: int, seed: int) -> dict[str, float]:
    """Run `accept_fn` n times on SAMPLING_TREE and test the committed tokens
    against the target: first token, first two tokens, whole sequence."""
    tree = SAMPLING_TREE
    g = make_generator(seed)
    runs = [tuple(accept_fn(tree, probs, g).tokens(tree)) for _ in range(n)]
    p = probs.double() / probs.double().sum(-1, keepdim=True)
    step = _first_child_with_token(tree, tree.children(), 0)

    first = Counter(r[0] for r in runs)
    first_p = {x: float(p[0, x]) for x in range(VOCAB)}

    # (x1, x2) for first tokens that stay in the tree; all others in one cell,
    # whose second token (if any) is not this cycle's business. A tree token
    # committed as the bonus (x1, None) has target probability 0.
    pair = Counter(
        (r[0], r[1] if len(r) > 1 else None) if r[0] in step else "left tree" for r in runs
    )
    pair_p = {"left tree": sum(float(p[0, x]) for x in range(VOCAB) if x not in step)}
    for x1, node in step.items():
        for x2 in range(VOCAB):
            pair_p[(x1, x2)] = float(p[0, x1]) * float(p[node, x2])

    return {
        "first": chi2_pvalue(first, first_p, n),
        "pair": chi2_pvalue(pair, pair_p, n),
        "sequence": chi2_pvalue(Counter(runs), _sequence_probs(tree, probs), n),
    }


TARGETS = {
    "T=1": SamplingParams(temperature=1.0),
    "T=0.7,top_p=0.9": SamplingParams(temperature=0.7, top_p=0.9),
}
N_RUNS = 20_000


@pytest.mark.parametrize("name", list(TARGETS))
def test_accept_sampling_is_lossless(name):
    probs = target_probs(_tree_logits(seed=160), TARGETS[name])
    assert probs[0, 4] == 0 and probs[1, 3] == 0
    pvalues = _lossless_pvalues(accept_sampling, probs, N_RUNS, seed=101)
    assert min(pvalues.values()) >= P_MIN, pvalues


@pytest.mark.parametrize("variant", ["no_zero", "no_renorm", "stale_bonus"])
def test_lossless_check_detects_broken_residual(variant):
    probs = target_probs(_tree_logits(seed=160), TARGETS["T=1"])
    broken = partial(_reference_accept, variant=variant)
    pvalues = _lossless_pvalues(broken, probs, N_RUNS, seed=101)
    assert min(pvalues.values()) < P_MIN, pvalues


@pytest.mark.parametrize("name", list(TARGETS))
def test_matches_plain_reference_draw_for_draw(name):
    # Same uniforms consumed in the same order => identical decisions.
    probs = target_probs(_tree_logits(seed=160), TARGETS[name])
    fast, ref = make_generator(5), make_generator(5)
    for _ in range(2000):
        want = _reference_accept(SAMPLING_TREE, probs, ref)
        assert accept_sampling(SAMPLING_TREE, probs, fast) == want


def test_impossible_and_duplicate_children_are_never_accepted():
    probs = target_probs(_tree_logits(seed=13), TARGETS["T=1"])
    g = make_generator(3)
    seen = Counter()
    for _ in range(3000):
        seen.update(accept_sampling(SAMPLING_TREE, probs, g).accepted)
    assert seen[2] == 0 and seen[6] == 0 and seen[10] == 0  # p = 0 (and below it)
    assert seen[3] == 0 and seen[9] == 0  # second copy of a token
    assert seen[1] > 0 and seen[4] > 0 and seen[8] > 0


def test_unnormalised_rows_are_normalised():
    probs = target_probs(_tree_logits(seed=14), TARGETS["T=1"])
    g1, g2 = make_generator(9), make_generator(9)
    for _ in range(300):  # x4 is exact in floating point
        want = accept_sampling(SAMPLING_TREE, probs * 4, g2)
        assert accept_sampling(SAMPLING_TREE, probs, g1) == want


def test_seed_reproduces_acceptance():
    probs = target_probs(_tree_logits(seed=15), TARGETS["T=1"])

    def run(seed: int) -> list[Acceptance]:
        g = make_generator(seed)
        return [accept_sampling(SAMPLING_TREE, probs, g) for _ in range(200)]

    assert run(42) == run(42)
    assert run(42) != run(43)


def test_accept_dispatches_on_params():
    logits = _tree_logits(seed=16)
    greedy = accept(SAMPLING_TREE, logits, SamplingParams())
    assert greedy == accept_greedy(SAMPLING_TREE, logits.argmax(-1))

    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
    got = accept(SAMPLING_TREE, logits, params, make_generator(8))
    assert got == accept_sampling(SAMPLING_TREE, target_probs(logits, params), make_generator(8))

    with pytest.raises(ValueError, match="generator"):
        accept(SAMPLING_TREE, logits, params)
    with pytest.raises(ValueError, match="top_p"):
        accept(SAMPLING_TREE, logits, SamplingParams(temperature=1.0, top_p=0.0), make_generator(0))
