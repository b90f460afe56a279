"""Lookahead decoding on the verifier: the target drafts for itself
(``specdec.tree.lookahead`` for the method, its vocabulary and the mask).

One step on a session, in one target forward:
  1. the verification branch: the pool's guesses for the root merged into a
     tree (``LookaheadState.tree``), no deeper than the loop asked;
  2. the lookahead branch: the window's cells after the tree's nodes, each at
     its own position, under ``lookahead_allowed``;
  3. acceptance on the tree's logits exactly as for a drafter's tree
     (``TargetSession.settle``: greedy walk, or recursive rejection with
     one-hot proposals); the cache keeps the prefix and the accepted path, the
     window's K/V is dropped with the rejected nodes';
  4. the window's argmaxes into the pool, the window slides.

The session's state (``TargetSession.lookahead``) is made on its first such
step, the pool seeded with the committed tokens (the prompt, or a moved
session's whole sequence), and goes with the session.
"""

from __future__ import annotations

import torch

from specdec.model.masks import tree_allowed
from specdec.tree.build import DraftTree
from specdec.request.lookahead import LookaheadParams
from specdec.tree.lookahead import LookaheadState, lookahead_allowed, window_layout, window_offsets
from verifier.session import TargetSession, VerifyResult
from verifier.target import TargetModel, check_tree


def lookahead_inputs(tree: DraftTree, cells: list[int], params: LookaheadParams,
                     prefix: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward's tokens [n + m] and positions [n + m] (the tree's nodes, then
    the window's ``cells`` in ``window_layout`` order; none: the tree alone) and
    what each sees, bool [n + m, prefix + n + m]."""
    tokens, positions = tree.tokens, tree.position_ids(prefix)                       # [n]
    if not cells:
        return tokens, positions, tree_allowed(tree.ancestor_mask(), prefix)
    _, sees = window_layout(params.window, params.ngram)
    tokens = torch.cat([tokens, torch.tensor(cells, dtype=torch.int64)])
    positions = torch.cat([positions, prefix + window_offsets(params.window, params.ngram)])
    return tokens, positions, lookahead_allowed(tree.ancestor_mask(), sees, prefix)


def lookahead_step(target: TargetModel, sess: TargetSession, params: LookaheadParams, depth: int) -> VerifyResult:
    """One lookahead decoding step on ``sess`` (its lock held): guesses at most
    ``depth`` deep; ``VerifyResult.nodes`` is the guess tree's size."""
    if sess.lookahead is None:
        sess.lookahead = LookaheadState(params, target.vocab_size, list(sess.tokens))
    state = sess.lookahead
    root, prefix = sess.tokens[-1], sess.prefix_len
    tree = state.tree(root, depth)
    check_tree(target, sess, tree)
    # near the end of the context the window would run past it: that step verifies the guesses alone
    cells = state.window.tokens() if prefix + params.window + params.ngram - 3 < target.max_positions else []
    tokens, positions, allowed = lookahead_inputs(tree, cells, params, prefix)
    k_pos = torch.cat([torch.arange(prefix), positions])
    mask = None if len(tokens) == 1 else target.masks(allowed[None], positions[None], k_pos[None])
    hidden, logits = target.forward(sess.cache, tokens, positions, mask, sess.feature_layers)
    n = tree.size
    if cells:
        nexts = logits[[0, *range(n, len(tokens))]].argmax(-1).tolist()     # the branch's one read
        state.update(root, nexts[0], nexts[1:])
    result = sess.settle(tree, prefix, hidden[:n], logits[:n])
    return VerifyResult(result.accepted, result.tokens, result.features, result.logprobs, nodes=n)
