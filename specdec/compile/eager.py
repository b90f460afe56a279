"""The eager forwards the compiled ones stand in for (``specdec.compile.forwards``),
and that run where no graph applies."""

from __future__ import annotations

import torch

from specdec.model.causal_lm import CausalLm


def eager_forward(lm: CausalLm, cache, tokens: torch.Tensor, positions: torch.Tensor, mask):
    """The eager forward ``CompiledForward.forward`` stands in for: (features fp32, logits)."""
    hidden = lm.hidden(cache, tokens, positions, mask)
    return hidden.float(), lm.logits(hidden)


def eager_run(lm: CausalLm, cache, tokens: torch.Tensor, positions: torch.Tensor, mask,
              layers: tuple[int, ...] = (), last_logits: bool = False):
    """The eager forward ``CompiledForward.run`` stands in for: (features fp32,
    the streams entering ``layers`` fp32 or None, logits: of the last token
    only with ``last_logits``, [B, 1, V])."""
    if not layers:
        hidden, streams = lm.hidden(cache, tokens, positions, mask), None
    else:
        hidden, streams = lm.hidden_and_layers(cache, tokens, positions, mask, layers)
        streams = streams.float()
    return hidden.float(), streams, lm.logits(hidden[:, -1:] if last_logits else hidden)
