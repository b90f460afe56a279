"""specdec.model.masks: the additive mask, windows by token position, and one mask
per layer type for hybrid stacks."""

import torch
from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

from specdec.model.masks import FULL, SLIDING, AttentionLayout, additive, causal_allowed, tree_allowed


def test_additive_is_zero_where_allowed_and_the_minimum_elsewhere():
    allowed = torch.tensor([[True, False], [True, True]])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        mask = additive(allowed, dtype)
        assert mask.dtype == dtype
        assert mask[0, 0] == 0 and mask[1, 0] == 0 and mask[1, 1] == 0
        assert mask[0, 1] == torch.finfo(dtype).min


def test_causal_window_is_transformers_sliding_window():
    """On a plain sequence the window matches transformers' own mask function."""
    window, past, n = 3, 5, 4
    layout = AttentionLayout((SLIDING,), window)
    positions = torch.arange(past, past + n)[None]
    mask = layout.masks(causal_allowed(n, past)[None], positions, torch.arange(past + n)[None])[0, 0]
    theirs = and_masks(causal_mask_function, sliding_window_overlay(window))
    for q in range(n):
        for k in range(past + n):
            assert (mask[q, k] == 0) == bool(theirs(0, 0, torch.tensor(past + q), torch.tensor(k)))


def test_tree_window_follows_positions_not_slots():
    """Siblings share a position: a node sees an ancestor two levels up even
    when many sibling slots lie between them, and never a prefix token the
    window excludes."""
    # tree: 0 root; 1, 2, 3 children of 0; 4 child of 3
    ancestor = torch.eye(5, dtype=torch.bool)
    ancestor[1:, 0] = True
    ancestor[4, 3] = True
    prefix, window = 6, 3
    positions = torch.tensor([6, 7, 7, 7, 8])
    layout = AttentionLayout((SLIDING, FULL), window)
    masks = layout.tree_masks(ancestor, prefix, positions)
    full, sliding = masks[FULL][0, 0] == 0, masks[SLIDING][0, 0] == 0
    assert torch.equal(full, tree_allowed(ancestor, prefix))
    # a key is visible when query position - key position < 3; the prefix's slot i holds position i
    assert sliding[4].nonzero().flatten().tolist() == [prefix + 0, prefix + 3, prefix + 4]
    assert sliding[0].nonzero().flatten().tolist() == [4, 5, prefix + 0]
    assert sliding[1].nonzero().flatten().tolist() == [5, prefix + 0, prefix + 1]
