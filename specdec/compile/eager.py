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
    return hidden.float(), streams, causal_logits(lm, hidden, mask, last_logits)


def causal_logits(lm: CausalLm, hidden: torch.Tensor, mask, last_only: bool) -> torch.Tensor:
    """The logits of a forward's rows (of its last only with ``last_only``). A
    causal forward's last row is multiplied on its own either way, so that a
    prompt's next-token logits are the same bits whether or not its other rows
    are scored (``prompt_logprobs``): a product's rounding depends on how many
    rows it takes."""
    if last_only:
        return lm.logits(hidden[:, -1:])
    if mask is not None or hidden.shape[1] == 1:
        return lm.logits(hidden)
    return torch.cat([lm.logits(hidden[:, :-1]), lm.logits(hidden[:, -1:])], dim=1)
