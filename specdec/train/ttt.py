"""Training-time test (EAGLE-3, arXiv:2503.01840 §3): the head is unrolled on
its own predictions for several steps, as it is when it drafts.

Vocabulary, for a window of S+1 tokens x_0..x_S and head positions t < S:
- step 0 is the teacher-forced step: the head reads embed(x_{t+1}) and the
  target's fused features fc(f_t) and predicts the target's distribution at
  t+1 (the token x_{t+2});
- step k > 0 reads embed(x_{t+1+k}) and *its own* step k-1 output at t (the
  hidden state it would feed itself while drafting) and predicts the target's
  distribution at t+1+k; positions with t+1+k > S have no target and are
  masked out of the loss.

Attention of the unrolled steps, as in the reference
(``eagle/traineagle3/cnets.py``): at step k the query at t sees the step-0
keys at positions <= t (the context, causal) and, for each step 1..k, only
the key of the same t (its own draft chain). Every step's keys are appended
to one cache, so step k attends over (k+1)*S slots with the mask ``ttt_mask``
builds, and the rotary position of step k is t + k.

Loss (the reference's): step k contributes the soft cross-entropy from the
target's distribution restricted to the draft vocabulary to the head's,
counted only where the target's argmax lies in the draft vocabulary and
averaged over all B*S positions, weighted by 0.8**k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from specdec.model import masks

STEP_DECAY = 0.8        # weight of step k: STEP_DECAY ** k
DEFAULT_STEPS = 7       # the reference unrolls 7 steps


@dataclass(frozen=True)
class TttBatch:
    """One batch of target outputs, ready for the unrolled head.

    features: [B, S, 3H] the target's hidden states at the head's layers, x_0..x_{S-1}
    tokens:   [B, S+1]   the window; the head at t reads x_{t+1+k} at step k
    target:   [B, S, N]  the target's logits at positions 1..S, restricted to the draft vocabulary
    in_draft: [B, S]     bool: the target's argmax at 1..S lies in the draft vocabulary
    weight:   [B, S]     bool: the positions 1..S whose predictions count (None: all;
                         chat data trains only where the next token is the assistant's)
    """

    features: torch.Tensor
    tokens: torch.Tensor
    target: torch.Tensor
    in_draft: torch.Tensor
    weight: torch.Tensor | None = None

    def counted(self) -> torch.Tensor:
        """bool [B, S]: positions with a target in the draft vocabulary that count."""
        return self.in_draft if self.weight is None else self.in_draft & self.weight


def ttt_allowed(seq_len: int, step: int) -> torch.Tensor:
    """bool [S, (step+1)*S]: step ``step``'s queries over the cache of steps 0..step."""
    eye = torch.eye(seq_len, dtype=torch.bool)
    return torch.cat([masks.causal_allowed(seq_len, 0)] + [eye] * step, dim=1)


def ttt_mask(seq_len: int, step: int, dtype=torch.float32) -> torch.Tensor:
    """Additive [1, 1, S, (step+1)*S] mask of ``ttt_allowed``."""
    return masks.additive(ttt_allowed(seq_len, step), dtype)[None, None]


def shifted(x: torch.Tensor, by: int, fill=0) -> torch.Tensor:
    """x [B, S, ...] moved ``by`` positions left along dim 1, padded with ``fill``."""
    if by == 0:
        return x
    pad = torch.full_like(x[:, :by], fill)
    return torch.cat([x[:, by:], pad], dim=1)


def step_weights(steps: int) -> list[float]:
    return [STEP_DECAY ** k for k in range(steps)]


def unrolled_hidden(head, embed_tokens, batch: TttBatch, steps: int):
    """Yield the head's output hidden states [B, S, H] at steps 0..steps-1
    (module doc); step k at t stands for the draft of x_{t+2+k}.

    head: has ``project(features)`` and ``forward(embeds, hidden, positions, mask, cache)``;
    embed_tokens: ids [B, n] -> [B, n, H]."""
    bsz, seq_len = batch.features.shape[:2]
    hidden = head.project(batch.features)                                    # [B, S, H]
    cache = DynamicCache()
    for k in range(steps):
        embeds = embed_tokens(batch.tokens[:, 1 + k: 1 + k + seq_len])      # x_{t+1+k}, [B, S-k, H]
        embeds = torch.cat([embeds, embeds.new_zeros(bsz, seq_len - embeds.shape[1], embeds.shape[2])], 1)
        positions = (torch.arange(seq_len) + k)[None].expand(bsz, -1)
        hidden = head(embeds, hidden, positions, ttt_mask(seq_len, k, hidden.dtype), cache)
        yield hidden


def unrolled_losses(head, embed_tokens, batch: TttBatch, steps: int) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted training-time-test loss of ``head`` on ``batch`` and, per
    step k, its loss ``loss_k`` and top-1 agreement ``top1_k`` with the target
    (over positions with a target whose argmax the draft vocabulary holds).
    ``head`` also has ``draft_logits(hidden)``.

    Only the positions that count go through the draft vocabulary's projection
    and softmax (a chat batch's prompts and padding are ~40% of it): step k's
    head position t counts where the target's position t+k does, so each step
    gathers those rows; the loss is still the sum over them divided by all B*S."""
    counted = batch.counted()                                               # [B, S]
    bsz, seq_len = counted.shape
    rows = counted.flatten().nonzero()[:, 0]                                # [M] flat positions with a target
    target = batch.target.flatten(0, 1)[rows].float()                      # [M, N]
    target_p, target_top = torch.softmax(target, -1), target.argmax(-1)
    at = rows % seq_len                                                     # each row's position in its window
    total = target_p.new_zeros(())
    metrics: dict[str, float] = {}
    weights = step_weights(steps)
    for k, hidden in enumerate(unrolled_hidden(head, embed_tokens, batch, steps)):
        keep = at >= k                                                      # the target at t+k: a head row at t
        logp = torch.log_softmax(head.draft_logits(hidden.flatten(0, 1)[rows[keep] - k]).float(), -1)
        loss_k = -(target_p[keep] * logp).sum() / (bsz * seq_len)
        total = total + weights[k] * loss_k
        hits = int((logp.argmax(-1) == target_top[keep]).sum())
        metrics[f"loss_{k}"] = float(loss_k.detach())
        metrics[f"top1_{k}"] = hits / max(1, int(keep.sum()))
    return total, metrics
