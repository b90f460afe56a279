"""One forward over a flattened tree == each root-to-leaf path run as a plain sequence."""

import pytest
import torch

from specdec.model import masks
from specdec.model.loading import ModelSpec
from specdec.tree.build import tree_from_lists
from verifier.engine import TargetModel


def random_tree(n: int, vocab: int, gen: torch.Generator):
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
    return tree_from_lists(tokens, parents, vocab)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tree_logits_equal_per_path_logits(tiny_family, attn):
    target = TargetModel(ModelSpec(str(tiny_family["target"]), attn_implementation=attn))
    gen = torch.Generator().manual_seed(1)
    v = target.vocab_size
    for trial in range(5):
        prefix = torch.randint(0, v, (7 + trial,), generator=gen)
        tree = random_tree(12, v, gen)
        cache = target.new_cache()
        target.forward(cache, prefix, torch.arange(len(prefix)), None)
        mask = masks.tree_attention_mask(tree.ancestor_mask(), len(prefix))
        feats, logits = target.forward(cache, tree.tokens, tree.position_ids(len(prefix)), mask)
        for path in tree.paths():
            seq = torch.cat([prefix, tree.tokens[path]])
            ref_feats, ref_logits = target.forward(target.new_cache(), seq, torch.arange(len(seq)), None)
            torch.testing.assert_close(logits[path], ref_logits[len(prefix):], atol=2e-5, rtol=0)
            torch.testing.assert_close(feats[path], ref_feats[len(prefix):], atol=2e-5, rtol=0)


def test_boolean_mask_would_differ_under_eager(tiny_family):
    """The additive float mask is not a style choice: a boolean 4-D mask is
    misread by eager attention (DESIGN.md §3). Guard that this test suite would
    notice if the mask builder regressed to booleans."""
    target = TargetModel(ModelSpec(str(tiny_family["target"]), attn_implementation="eager"))
    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, target.vocab_size, (6,), generator=gen)
    tree = random_tree(8, target.vocab_size, gen)
    outs = []
    for boolean in (False, True):
        cache = target.new_cache()
        target.forward(cache, prefix, torch.arange(6), None)
        mask = masks.tree_attention_mask(tree.ancestor_mask(), 6)
        if boolean:
            mask = mask == 0
        outs.append(target.forward(cache, tree.tokens, tree.position_ids(6), mask)[1])
    assert not torch.allclose(outs[0], outs[1], atol=1e-4)
