"""Sampled trees drafted on the device: ``specdec.tree.build``'s sampled
builder with every decision kept on the model's device and one read at the end.

The level-by-level sampled builder (``specdec.tree.build._build_sampled``)
decides on the host: each level reads the draft distribution's support, shares
the level's draws among its parents, draws, and reads the drawn tokens back
to feed the next level (~90 host syncs a cycle of the demo head). Nothing of
that needs the host. A level's number of draws is fixed by the budget
(``sampled_level_budget``), so every level has a fixed shape: its frontier
is the previous level's draws, ``width`` rows, some of which may be *dead*
(a parent whose proposal ran out of tokens drew fewer children than the
budget gave the level: the rows past the real draws are kept, their outputs
unused, and they draw nothing). Per level, on the device:

- the proposals: the draft distribution under the session's filters (no
  penalties), cut to ``support`` tokens (``ProposalSampler.proposals``);
- the draws' worth (parent's path value plus the draw's prior, as the host
  values them) and the level's ``width`` best of them, ties to the earlier
  parent and the earlier draw, so each parent's draws are a prefix of its
  Gumbel order (``ProposalSampler.draw_order``), in parent order;
- the next frontier's inputs: tokens, their parents' outputs, positions and
  the attention rows (each node sees the committed slots, its ancestors'
  draft slots and its own).

The tree, its nodes' proposals and which nodes are real come back in one
read; the host then drops the dead nodes. Which parents draw how many
children depends on the proposals and the values only, never on the draws,
so the tree stays lossless (``specdec.tree.proposals``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.request.params import TreeParams
from specdec.tree.build import SAMPLED_NEXT_RATIO, sampled_level_budget
from specdec.tree import placed
from specdec.tree.acceptance import ProposalTable
from specdec.tree.layout import DraftTree
from specdec.tree.proposals import Proposal, ProposalSampler

# one level of the draft model over a frontier, all on its device: tokens [w], the parents' outputs [w, H],
# positions [w], attention rows [w, committed + drafted + w] bool -> (outputs [w, H], log-probs [w, V])
LevelFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def serves(cfg: TreeParams) -> bool:
    """Whether ``draft_drawn`` drafts ``cfg``'s sampled trees: a budget with a
    draw at least (the shaped "static" method stays level by level on the host)."""
    return cfg.method in ("eagle2", "no-value", "no-rerank", "chain") and bool(level_widths(cfg))


def level_widths(cfg: TreeParams) -> list[int]:
    """The draws of each level, as the host builder shares them."""
    if cfg.method == "chain":
        widths = [1] * min(cfg.depth, cfg.total_tokens - 1)
    else:
        widths = sampled_level_budget(cfg.total_tokens, cfg.depth, cfg.expand_k)
    return widths[:next((i for i, w in enumerate(widths) if w == 0), len(widths))]


def pool_depths(depths: list[int], device) -> torch.Tensor:
    """A pool's depths (host ints, each level a run of pool ids) as a device
    tensor made there, nothing copied up: [len(depths)] int64."""
    out = torch.zeros(len(depths), dtype=torch.long, device=device)
    for d in range(1, max(depths) + 1):
        out[depths.index(d):len(depths) - depths[::-1].index(d)].fill_(d)
    return out


@dataclass(frozen=True)
class DrawnDraft:
    """A sampled draft on the device, unread: ``read`` [R] fp64 (``resolve``),
    and the pool it came from (``place``)."""

    read: torch.Tensor
    nodes: int                 # pool nodes, the root included
    rows: int                  # expanded rows (each may hold a proposal)
    support: int
    most: int                  # the most children a node may draw
    pool: tuple                # (tokens, parents, real [nodes], depths [nodes] host list, row nodes, counts,
                               #  tokens, probs [rows, ...]) on the device

    def place(self, prefix: int, width: int) -> tuple[torch.Tensor, ProposalTable]:
        """The tree placed for its verify after ``prefix`` slots, ``width`` >=
        ``nodes`` wide, its real nodes first in pool order (the tree ``resolve``
        gives) and the dead ones after them as nodes the walk never takes
        (``placed.STEP`` 0), with its proposals in those indices: ([ROWS, width]
        int64, ``ProposalTable``), on the device, nothing read."""
        tokens, parents, real, depths, row_nodes, row_counts, row_tokens, row_probs = self.pool
        n, device = self.nodes, tokens.device
        index = torch.arange(n, device=device)
        kept = real.long().cumsum(0)
        where = torch.where(real, kept - 1, kept[-1] + (~real).long().cumsum(0) - 1)   # pool id -> tree index
        order = torch.empty_like(index).index_copy_(0, where, index)                   # tree index -> pool id
        depth = pool_depths(depths, device)[order]
        parent = torch.where(parents[order] >= 0, where[parents[order].clamp(min=0)], 0)
        live = real[order] & (index > 0)
        rows = placed.place_rows(tokens[order], parent, depth, live, real[order], prefix, width, max(depths))
        nodes = torch.where(row_counts > 0, where[row_nodes], n)          # a row that drew nothing: none (n)
        return rows, ProposalTable(nodes, row_tokens, row_probs, self.most)

    def resolve(self, values: list[float]) -> DraftTree | None:
        """The tree out of ``read``'s values: the real nodes in pool order, with
        the proposals of those that drew children. None where a draft
        distribution was not finite (the level-by-level builder then raises)."""
        if values[0] != 1.0:
            return None
        n, rows, s = self.nodes, self.rows, self.support
        at = 1
        tokens, parents, real, values_ = (values[at + i * n: at + (i + 1) * n] for i in range(4))
        at += 4 * n
        row_node, row_count = values[at:at + rows], values[at + rows:at + 2 * rows]
        at += 2 * rows
        prop_tokens, prop_probs = values[at:at + rows * s], values[at + rows * s:at + 2 * rows * s]
        index = {}                                  # pool id -> tree index
        toks, pars, depths, vals = [], [], [], []
        for i in range(n):
            if real[i] != 1.0:
                continue
            index[i] = len(toks)
            toks.append(int(tokens[i]))
            pars.append(-1 if i == 0 else index[int(parents[i])])
            depths.append(0 if i == 0 else depths[pars[-1]] + 1)
            vals.append(values_[i])
        proposals = {}
        for r in range(rows):
            if row_count[r] < 1:
                continue
            probs = prop_probs[r * s:(r + 1) * s]
            m = sum(1 for p in probs if p > 0.0)    # the support (zeros pad the end, most likely first)
            proposals[index[int(row_node[r])]] = Proposal(
                torch.tensor([int(t) for t in prop_tokens[r * s:r * s + m]], dtype=torch.int64),
                torch.tensor(probs[:m], dtype=torch.float32))
        return DraftTree(torch.tensor(toks, dtype=torch.int64), torch.tensor(pars, dtype=torch.int64),
                         torch.tensor(depths, dtype=torch.int64), torch.tensor(vals, dtype=torch.float32),
                         proposals, lists=(toks, pars, depths))


def draft_drawn(root_token: int, root_hidden: torch.Tensor, root_logp: torch.Tensor, level: LevelFn,
                committed: int, cfg: TreeParams, sampler: ProposalSampler) -> DrawnDraft:
    """The sampled tree of ``cfg`` under the root (its output ``root_hidden``
    [H] and next-token log-probs ``root_logp`` [V], on the device), drafted
    there level by level through ``level`` after ``committed`` cached slots
    (module doc); nothing read."""
    device = root_logp.device
    widths = level_widths(cfg)
    k, step = cfg.expand_k if cfg.method != "chain" else 1, math.log(SAMPLED_NEXT_RATIO)
    by_value = cfg.method != "no-value"
    # the pool, in creation order (pool id = position)
    tokens = torch.full((1,), root_token, dtype=torch.long, device=device)
    parents = torch.full((1,), -1, dtype=torch.long, device=device)
    real = torch.ones(1, dtype=torch.bool, device=device)
    values = torch.zeros(1, device=device)
    gains = torch.zeros(1, device=device)
    ok = torch.ones((), dtype=torch.bool, device=device)
    frontier = torch.zeros(1, dtype=torch.long, device=device)       # pool ids of the rows expanded next
    front_hidden, logp = root_hidden[None], root_logp[None]
    sees = torch.zeros(1, 0, dtype=torch.bool, device=device)        # each row's ancestors' draft slots
    row_nodes, row_counts, row_tokens, row_probs = [], [], [], []
    slots = torch.arange(min(k, sampler.support, root_logp.shape[-1]), device=device)   # a row's draws
    slot_steps = slots.double() * step                               # each draw's log prior after the first
    committed_seen = torch.ones(max(widths), committed, dtype=torch.bool, device=device)
    for depth, width in enumerate(widths, start=1):
        f = frontier.shape[0]
        prop_tokens, q = sampler.proposals(logp)                     # [f, s]
        ok = ok & torch.isfinite(q).all()
        support = (q > 0).sum(-1)                                    # [f]
        first = torch.log(0.5 + 0.5 * q[:, 0].double())              # [f] log prior of each row's first draw
        key = (values if by_value else gains)[frontier].double() + first
        worth = key[:, None] + slot_steps                            # [f, k]
        valid = (slots[None] < support[:, None]) & real[frontier][:, None]
        flat = torch.where(valid, worth, -math.inf).flatten()
        chosen = torch.sort(flat, descending=True, stable=True).indices[:width]   # ties: earlier row, draw
        taken = valid.flatten()[chosen]
        chosen = chosen[torch.sort(torch.where(taken, chosen, chosen + flat.shape[0])).indices]   # row order
        taken = valid.flatten()[chosen]
        row, rank = chosen // slots.shape[0], chosen % slots.shape[0]
        counts = torch.zeros(f, dtype=torch.long, device=device).index_add_(0, row, taken.long())
        order = sampler.draw_order(q)                                # [f, s] each row's draw order
        drawn = prop_tokens[row, order[row, rank]]                   # [width]
        gain = (first[row] + slot_steps[rank]).float()
        row_nodes.append(frontier)
        row_counts.append(counts)
        row_tokens.append(prop_tokens)
        row_probs.append(q)
        kid_parents = frontier[row]
        tokens = torch.cat([tokens, torch.where(taken, drawn, 0)])
        parents = torch.cat([parents, kid_parents])
        real = torch.cat([real, taken])
        values = torch.cat([values, values[kid_parents] + gain])
        gains = torch.cat([gains, gain])
        if depth == len(widths):
            break
        own = torch.eye(width, dtype=torch.bool, device=device)
        sees = torch.cat([sees[row], own], dim=1)                    # [width, drafted + width]
        allowed = torch.cat([committed_seen[:width], sees], dim=1)
        positions = torch.full((width,), committed - 1 + depth, dtype=torch.long, device=device)
        front_hidden, logp = level(tokens[-width:], front_hidden[row], positions, allowed)
        frontier = torch.arange(tokens.shape[0] - width, tokens.shape[0], device=device)
    nodes, rows = tokens.shape[0], sum(t.shape[0] for t in row_nodes)
    s = row_tokens[0].shape[-1]
    row_nodes, row_counts, row_tokens, row_probs = (torch.cat(t) for t in (row_nodes, row_counts, row_tokens,
                                                                           row_probs))
    read = torch.cat([ok.reshape(1).double(), tokens.double(), parents.double(), real.double(), values.double(),
                      row_nodes.double(), row_counts.double(), row_tokens.flatten().double(),
                      row_probs.flatten().double()])
    depths = [0] + [d for d, w in enumerate(widths, start=1) for _ in range(w)]
    return DrawnDraft(read, nodes, rows, s, min(k, max(widths)),
                      (tokens, parents, real, depths, row_nodes, row_counts, row_tokens, row_probs))
