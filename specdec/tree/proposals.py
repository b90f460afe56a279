"""Sampled proposals: draft tokens drawn from the draft model's distribution.

With deterministic (top-k) proposals the verifier accepts a drafted token x
with the target's own probability p(x) (``specdec.tree.acceptance``), which at
temperature 1 is low whenever the target is uncertain, however good the
drafter. Sampled proposals fix that: the children of an expanded node are a
sample *without replacement* from the draft distribution q there, shipped with
the tree, and the verifier runs recursive rejection sampling on them:

- child i (token x_i, drawn from q_i = q with x_1..x_{i-1} removed, renormalised)
  is accepted with probability min(1, p_i(x_i) / q_i(x_i));
- on rejection the target residual becomes p_{i+1} = norm(max(0, p_i - q_i));
- when every child is rejected, the bonus token is drawn from the last residual.

Each step is the speculative-sampling rule (Leviathan et al., 2023,
arXiv:2211.17192; Chen et al., 2023, arXiv:2302.01318), whose output is
distributed as p_i for any proposal, and the recursion over candidates drawn
without replacement is Recursive Speculative Decoding (Jeon et al., 2024,
arXiv:2402.14160). A chain of one candidate per node is classic speculative
sampling. Acceptance per node becomes sum_x min(p(x), q(x)) for the first
candidate, far above p(x) of a fixed token when p is flat and q is close to it.

What a tree may do with sampled children and stay lossless: how many children
a node gets may depend on anything drafted before them (the node's own value,
other branches), never on the children themselves. So a sampled tree is not
reranked: a drafted candidate is never dropped for its own value.

Vocabulary:
- proposal: the distribution a node's children were drawn from, sparse
  (``tokens`` [m] distinct, ``probs`` [m] summing to 1); the children, in index
  order, are the draws in the order they were made.
- support: the tokens a proposal can draw. The draft distribution is cut to its
  ``PROPOSAL_SUPPORT`` most likely tokens and renormalised before drawing, so
  that a proposal is small on the wire; the cut one is the proposal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.request.params import SamplingParams
from specdec.tree.sampling import moved_to, target_probs

PROPOSAL_SUPPORT = 64    # tokens kept of a draft distribution before drawing from it
_SUM_SLACK = 1e-3        # a proposal's probs must sum to 1 within this (fp32 on the wire)


class ProposalError(ValueError):
    """A proposal that does not describe how its node's children were drawn."""


@dataclass(frozen=True)
class Proposal:
    tokens: torch.Tensor  # [m] int64, distinct
    probs: torch.Tensor   # [m] float32, > 0, sums to 1


def _mix(seed: int, salt: int) -> int:
    """A 63-bit seed from (seed, salt): splitmix64 of their combination."""
    z = (seed * 0x9E3779B97F4A7C15 + salt + 0x632BE59BD9B4E5) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1


class ProposalSampler:
    """Draws a tree's sampled children: the draft distribution under the
    session's sampling params (as the target's is filtered), cut to
    ``support`` tokens, drawn from without replacement by Gumbel-top-k, run as
    an exponential race (``draw_order``; the order of Gumbel-perturbed
    log-probs is a sequential draw without replacement; Kool et al., 2019,
    arXiv:1903.06059).

    ``seed`` and ``salt`` fix the draws: a drafter salts with the committed
    length, so a session redrafted at the same point (after a failover) draws
    the same tree."""

    def __init__(self, params: SamplingParams, seed: int, salt: int = 0, support: int = PROPOSAL_SUPPORT,
                 device: str | torch.device = "cpu"):
        params.validate()
        if params.greedy:
            raise ValueError("sampled proposals need temperature > 0")
        if support < 1:
            raise ValueError(f"support must be >= 1, got {support}")
        # The draft distribution is biased and filtered like the target's
        # (logit bias, temperature, top-k, top-p, min-p) but not penalised:
        # penalties need each node's path history, and acceptance is lossless
        # whatever q is. The bias keeps q near a target it bans or forces tokens of.
        self.params, self.support = params.without_penalties(), support
        self.generator = torch.Generator(device).manual_seed(_mix(seed, salt))

    def proposals(self, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logp: [f, V] draft log-probs -> (tokens [f, s] int64, probs [f, s] fp32)
        on their device, unchecked (a non-finite row gives non-finite probs):
        each row's proposal, most likely first; rows with fewer than s tokens
        left by the filters have prob-0 padding at the end."""
        q = target_probs(logp.float(), self.params)          # log-probs are logits up to a constant
        s = min(self.support, q.shape[-1])
        probs, tokens = q.topk(s, dim=-1)                   # [f, s]
        probs = probs / probs.sum(-1, keepdim=True)
        return tokens, probs

    def draw_order(self, probs: torch.Tensor) -> torch.Tensor:
        """probs: [f, s] proposals -> [f, s] each row's positions in draw order
        (an exponential race: E_i / p_i ascending, E_i ~ Exp(1), is a
        sequential draw without replacement, the order Gumbel-top-k gives:
        log p_i - log E_i is log p_i plus a Gumbel; a row's first c are c
        draws), on their device; positions of prob 0 come last."""
        race = torch.empty(probs.shape, dtype=torch.float64, device=self.generator.device)
        race = moved_to(race.exponential_(generator=self.generator), probs.device)
        return (race / probs.double()).argsort(dim=-1)

    def draw(self, probs: torch.Tensor, counts: list[int]) -> list[list[int]]:
        """probs: [f, s] proposals; counts[r]: draws for row r (at most its
        support). Returns, per row, the drawn positions in draw order."""
        order = self.draw_order(probs)
        return [order[r, :c].tolist() for r, c in enumerate(counts)]


def check_proposals(proposals: dict[int, Proposal], tokens: list[int], parents: list[int],
                    vocab_size: int | None = None) -> dict[int, Proposal]:
    """Raise ProposalError naming the first proposal that cannot have drawn its
    node's children; returns the proposals with probs renormalised in fp32."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents[1:], start=1):
        children.setdefault(p, []).append(i)
    out = {}
    for node, prop in proposals.items():
        where = f"proposal of node {node}"
        if not 0 <= node < len(tokens):
            raise ProposalError(f"{where}: the tree has {len(tokens)} nodes")
        kids = children.get(node, [])
        if not kids:
            raise ProposalError(f"{where}: the node has no children")
        toks, probs = prop.tokens.tolist(), prop.probs.double()
        if len(toks) != len(probs) or not toks:
            raise ProposalError(f"{where}: {len(toks)} tokens and {len(probs)} probs (need as many, >= 1)")
        if len(set(toks)) != len(toks):
            raise ProposalError(f"{where}: tokens repeat")
        bad = next((t for t in toks if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
        if bad is not None:
            raise ProposalError(f"{where}: token {bad} is outside the vocabulary")
        if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):
            raise ProposalError(f"{where}: probs must be finite and >= 0")
        total = float(probs.sum())
        if abs(total - 1.0) > _SUM_SLACK:
            raise ProposalError(f"{where}: probs sum to {total:.6g}, not 1")
        support = {t: float(p) for t, p in zip(toks, probs.tolist())}
        drawn = [tokens[k] for k in kids]
        if len(set(drawn)) != len(drawn):
            raise ProposalError(f"{where}: children repeat a token (draws are without replacement)")
        missing = next((t for t in drawn if support.get(t, 0.0) <= 0.0), None)
        if missing is not None:
            raise ProposalError(f"{where}: child token {missing} has no probability in it")
        out[node] = Proposal(prop.tokens.to(torch.int64), (probs / total).float())
    return out
