"""Top-token trees drafted on the device: ``specdec.tree.build``'s builders
for the "eagle2", "no-value", "no-rerank" and "chain" methods with every
decision kept on the model's device, for any drafter with a level function
(an EAGLE head eager or compiled level by level, a draft LM).

The level-by-level builder reads each level's top-k back to decide ties and
to feed the next level (~15–20 host syncs a cycle of a chain). Its shapes
are fixed by the budget: the root's ``k`` children, then ``width`` frontier
nodes a level (``expand_k``, 1 for a chain) with ``k`` children each; the
frontier is the ``width`` best children by value (by their own log-prob for
"no-value"), ties to the earlier; the tree is the ``total_tokens - 1`` best
nodes by value ("eagle2", "no-value": a parent is never below its child, so
every kept node's parent is kept) or the chosen frontiers in order ("no-rerank",
"chain"). Ties between log-probs go to the lower token id, as the host builder
gives them, without a read (``top_untied``: a top-k does not promise that order
by itself). What the device cannot decide is flagged: a row whose best is not a
log-prob, or whose tie at the k-th place may run past its 2k candidates. A flagged
draft is drafted again level by level (the reader's fallback), so every tree is
the one the host builder drafts from the same log-probs.

The tree comes back as ``drafter.compiled.whole_draft`` lays its read out
(exact flag, then the tree's tokens, parents, depths and values), placed for
its verify on the device as well (``specdec.tree.placed.place_rows``): an
in-process verifier runs it unread (``DeviceTree``).
"""

from __future__ import annotations

import torch

from specdec.request.params import TreeParams
from specdec.tree import placed
from specdec.tree.build import LOGP_SLACK, logsumexp
from specdec.tree.drawn import pool_depths
from specdec.tree.layout import best_positions

SERVED = ("eagle2", "no-value", "no-rerank", "chain")


def serves(cfg: TreeParams, vocab: int) -> bool:
    """Whether ``draft_ranked`` drafts ``cfg``'s top-token trees (a vocabulary
    wider than a level's top-k plus one; the shaped "static" method stays on the host)."""
    return cfg.method in SERVED and cfg.total_tokens >= 2 and cfg.depth >= 1 and cfg.expand_k + 1 < vocab


def nodes(cfg: TreeParams) -> int:
    """The size of ``draft_ranked``'s tree of ``cfg`` (known before drafting)."""
    k = 1 if cfg.method == "chain" else cfg.expand_k
    levels = min(cfg.depth, cfg.total_tokens - 1)
    if cfg.method in ("eagle2", "no-value"):
        return min(cfg.total_tokens, 1 + k + (levels - 1) * k * k)
    return 1 + min(cfg.total_tokens - 1, levels * k)


def top_untied(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's k best tokens [f, V] ranked as ``specdec.tree.build._top_tokens``
    ranks them (best first, equal log-probs to the lower token id) with no read:
    a top-k takes 2k candidates, and an integer key a candidate (its log-prob's
    order above its id's) ranks them with no tie left. -> (log-probs [f, k] fp32,
    tokens [f, k], whether that is exact: every row's best is a log-prob, and its
    last candidate is below its k-th, so no token left out ties with the k-th)."""
    m = min(2 * k, logp.shape[-1])
    lp, tok = torch.topk(logp, m, dim=-1)                              # NaNs rank first: lp[:, 0] tells
    lp = lp.float()
    ok = (lp[:, 0] <= LOGP_SLACK).all()
    if m < logp.shape[-1]:
        ok = ok & (lp[:, m - 1] < lp[:, k - 1]).all()                  # nothing left out equals the k-th
    bits = lp.view(torch.int32)                 # (-0.0 would rank below 0.0: no two tokens both have log-prob 0)
    order = bits ^ ((bits >> 31) & 0x7FFFFFFF)                         # a float32's order as an int32's
    key = order.long() * (1 << 32) + ((1 << 32) - 1 - tok)            # then the lower id first
    pick = torch.topk(key, k, dim=-1).indices
    return lp.gather(-1, pick).clamp(max=0.0), tok.gather(-1, pick), ok


def _top(logp: torch.Tensor, k: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's k best tokens [f, V] -> (value-tempered log-probs [f, k], tokens
    [f, k], whether the ranking is exact: ``top_untied``)."""
    lp, tok, ok = top_untied(logp, k)
    if temperature != 1.0:
        lse = logsumexp(logp.float() / temperature)
        lp = torch.where(torch.isfinite(lse), (lp / temperature - lse).clamp(max=0.0), lp)
    return lp, tok, ok


def draft_ranked(root_token: int, root_hidden: torch.Tensor, root_logp: torch.Tensor, level, committed: int,
                 cfg: TreeParams, prefix: int, width: int | None) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """The top-token tree of ``cfg`` under the root (its output ``root_hidden``
    [H] and log-probs ``root_logp`` [V] on the device), drafted there through
    ``level`` (``specdec.tree.drawn.LevelFn``) after ``committed`` cached slots
    -> (the read [1 + 4n] fp64, the tree placed after ``prefix`` slots
    ``width`` wide [ROWS, width] or None where ``width`` is None, n)."""
    device = root_logp.device
    k = 1 if cfg.method == "chain" else cfg.expand_k
    levels = min(cfg.depth, cfg.total_tokens - 1)
    temperature = float(cfg.value_temperature or 1.0)
    by_value = cfg.method != "no-value"
    lp, tok, ok = _top(root_logp[None], k, temperature)                     # [1, k]
    tokens = torch.cat([torch.full((1,), root_token, dtype=torch.long, device=device), tok[0]])
    parents = torch.cat([torch.full((1,), -1, dtype=torch.long, device=device), torch.zeros_like(tok[0])])
    values = torch.cat([torch.zeros(1, device=device), lp[0]])
    own = torch.cat([torch.zeros(1, device=device), lp[0]])                # each node's own log-prob
    depths = [0] + [1] * k
    key = values[1:] if by_value else own[1:]
    pick = best_positions(key, k)                                                     # the first frontier, of the root's k
    frontier = 1 + pick
    chosen = [frontier]
    hidden = root_hidden[None].expand(k, -1)
    sees = torch.zeros(k, 0, dtype=torch.bool, device=device)                # each frontier node's drafted ancestors
    for depth in range(2, levels + 1):
        f = frontier.shape[0]
        mine = torch.eye(f, dtype=torch.bool, device=device)
        sees = torch.cat([sees, mine], dim=1)                                # its own slot, after its ancestors'
        allowed = torch.cat([torch.ones(f, committed, dtype=torch.bool, device=device), sees], dim=1)
        positions = torch.full((f,), committed - 2 + depth, dtype=torch.long, device=device)
        out, logp = level(tokens[frontier], hidden, positions, allowed)
        lp, tok, level_ok = _top(logp, k, temperature)                       # [f, k]
        ok = ok & level_ok
        kid_parents = frontier.repeat_interleave(k)
        start = tokens.shape[0]
        tokens = torch.cat([tokens, tok.flatten()])
        parents = torch.cat([parents, kid_parents])
        values = torch.cat([values, values[kid_parents] + lp.flatten()])
        own = torch.cat([own, lp.flatten()])
        depths += [depth] * (f * k)
        kids = start + torch.arange(f * k, device=device)
        pick = best_positions((values if by_value else own)[kids], k)
        frontier = kids[pick]
        chosen.append(frontier)
        hidden, sees = out[pick // k], sees[pick // k]
    if cfg.method in ("eagle2", "no-value"):
        n = min(cfg.total_tokens, tokens.shape[0])
        keep = best_positions(values[1:], n - 1) + 1
    else:
        keep = torch.cat(chosen)[:cfg.total_tokens - 1]
        n = 1 + keep.shape[0]
    ids = torch.cat([torch.zeros(1, dtype=torch.long, device=device), keep])   # [n], pool order
    where = torch.full_like(tokens, -1).index_copy(0, ids, torch.arange(n, device=device))
    tree_parents = torch.cat([torch.full((1,), -1, dtype=torch.long, device=device), where[parents[keep]]])
    tree_depths = pool_depths(depths, device)[ids]
    read = torch.cat([ok.reshape(1).double(), tokens[ids].double(), tree_parents.double(), tree_depths.double(),
                      values[ids].double()])
    if width is None:
        return read, None, n
    index = torch.arange(n, device=device)
    rows = placed.place_rows(tokens[ids], tree_parents.clamp(min=0), tree_depths, index > 0,
                             torch.ones(n, dtype=torch.bool, device=device), prefix, width, levels)
    return read, rows, n
