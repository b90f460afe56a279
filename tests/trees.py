"""Assertions on draft trees shared by the drafter tests."""

import torch


def assert_same_tree(got, want):
    """Two drafts are the same tree: tokens, parents and proposals exactly; values
    and proposal probabilities to float rounding (a padded or batched forward may
    sum in another order)."""
    assert not isinstance(got, Exception), got
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.parents.tolist() == want.parents.tolist()
    assert torch.allclose(got.values, want.values, rtol=0, atol=1e-4), (got.values - want.values).abs().max()
    assert (got.proposals or {}).keys() == (want.proposals or {}).keys()
    for node, prop in (got.proposals or {}).items():
        assert prop.tokens.tolist() == want.proposals[node].tokens.tolist()
        assert torch.allclose(prop.probs, want.proposals[node].probs, rtol=0, atol=1e-5)
