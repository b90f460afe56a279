"""ALiBi under a draft tree (``specdec.model.alibi``), checked at the logits: every
node of a tree forward, in every row of a padded batch whose rows have
different prefix lengths, gets the logits of the model's own plain forward of
its path (siblings at one depth share a position, hence a bias); a cache
rolled back to a non-contiguous tree path continues exactly; and a model
whose biases follow cache slots instead of positions is refused at load."""

import pytest
import torch
from families import BY_NAME, build_model

from specdec.model import alibi, kv
from specdec.model.causal_lm import CausalLm, UnsupportedModel
from specdec.model.masks import tree_allowed

ALIBI = ["falcon-alibi", "bloom", "mpt"]
V = 64
# a tree with siblings at depths 1 and 2: parent of each node (-1: the root)
PARENTS = [-1, 0, 0, 1, 1, 2]
TOL = 1e-4


def ancestors(parents: list[int]) -> torch.Tensor:
    """bool [n, n]: node i sees node j when j is i or one of its ancestors."""
    n = len(parents)
    out = torch.eye(n, dtype=torch.bool)
    for i in range(n):
        j = parents[i]
        while j >= 0:
            out[i, j] = True
            j = parents[j]
    return out


def depths(parents: list[int]) -> torch.Tensor:
    d = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return torch.tensor(d)


def path_of(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def own_logits(model, tokens: list[int]) -> torch.Tensor:
    """The model's own plain forward: logits of the last token, fp32."""
    return model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return float((got - want).abs().max() / (1.0 + want.abs().max())) < TOL


@pytest.mark.parametrize("name", ALIBI)
@torch.inference_mode()
def test_batched_tree_forward_matches_the_models_own_forward(name):
    model = build_model(BY_NAME[name], V)
    lm = CausalLm(model)
    gen = torch.Generator().manual_seed(1)
    prefixes = [torch.randint(1, V, (n,), generator=gen) for n in (5, 9)]
    trees = [torch.randint(1, V, (len(PARENTS),), generator=gen) for _ in prefixes]
    caches = []
    for p in prefixes:
        cache = lm.new_cache()
        lm.hidden(cache, p[None], torch.arange(len(p))[None], None)
        caches.append(cache)
    # padded batch: row b's prefix in slots [0, len_b), padding up to P, then the tree
    B, P, N = len(prefixes), max(len(p) for p in prefixes), len(PARENTS)
    batch = lm.new_cache()
    kv.gather_rows(batch, caches, [len(p) for p in prefixes], P, N)
    allowed = torch.zeros(B, N, P + N, dtype=torch.bool)
    positions = torch.stack([len(p) + depths(PARENTS) for p in prefixes])            # [B, N]
    for b, p in enumerate(prefixes):
        allowed[b, :, :len(p)] = True
        allowed[b, :, P:] = ancestors(PARENTS)
    key_positions = torch.cat([torch.arange(P).expand(B, P), positions], dim=1)
    mask = lm.masks(allowed, positions, key_positions)
    # siblings (same depth) get the same bias in a row; rows differ where their positions do
    assert torch.equal(mask.bias[:, :, P + 1], mask.bias[:, :, P + 2])
    assert not torch.equal(mask.bias[0, :, P:], mask.bias[1, :, P:])
    logits = lm.logits(lm.hidden(batch, torch.stack(trees), positions, mask))           # [B, N, V]
    for b, p in enumerate(prefixes):
        for node in range(N):
            want = own_logits(model, p.tolist() + trees[b][path_of(PARENTS, node)].tolist())
            assert close(logits[b, node], want), f"{name}: row {b}, node {node}"


@pytest.mark.parametrize("name", ALIBI)
@torch.inference_mode()
def test_cache_rolled_back_to_a_tree_path_continues_exactly(name):
    model = build_model(BY_NAME[name], V)
    lm = CausalLm(model)
    gen = torch.Generator().manual_seed(2)
    prefix, tree = torch.randint(1, V, (6,), generator=gen), torch.randint(1, V, (len(PARENTS),), generator=gen)
    cache = lm.new_cache()
    lm.hidden(cache, prefix[None], torch.arange(6)[None], None)
    positions = 6 + depths(PARENTS)
    k_pos = torch.cat([torch.arange(6), positions])
    allowed = tree_allowed(ancestors(PARENTS), 6)
    lm.hidden(cache, tree[None], positions[None], lm.masks(allowed[None], positions[None], k_pos[None]))
    path = path_of(PARENTS, 5)                       # [0, 2, 5]: not contiguous from the root
    kv.keep_path(cache, 6, path)
    assert kv.seq_len(cache) == 6 + len(path)
    nxt = torch.randint(1, V, (1,), generator=gen)
    got = lm.logits(lm.hidden(cache, nxt[None], torch.tensor([[6 + len(path)]]), None))[0, -1]
    assert close(got, own_logits(model, prefix.tolist() + tree[path].tolist() + nxt.tolist()))


@pytest.mark.parametrize("name", ALIBI)
def test_biases_by_cache_slot_are_refused(name, monkeypatch):
    """The bug ALiBi models had under trees: biases from slots, not positions.
    The load check sees it (the siblings' slots are not their positions)."""
    by_position = alibi.AlibiStack.mask

    def by_slot(self, allowed, key_positions):
        slots = torch.arange(key_positions.shape[1]).expand_as(key_positions)
        return by_position(self, allowed, slots)

    monkeypatch.setattr(alibi.AlibiStack, "mask", by_slot)
    with pytest.raises(UnsupportedModel, match="does not reproduce its own forward"):
        CausalLm(build_model(BY_NAME[name], V))
