"""The base of specdec's quantized linear layers (``specdec.model.quantize``,
``specdec.model.w8a8``): ``y = x W^T (+ b)`` over weights held quantized."""

from __future__ import annotations

import torch
from torch import nn

COMPUTE = torch.bfloat16                # the dtype the weight-only kernels multiply in


def int8_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: codes ``round(w / s)`` in [-127, 127] and
    the scales ``s = max|w| / 127`` per output row (fp32)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class QuantizedLinear(nn.Module):
    """``y = x W^T (+ b)`` over a quantized ``W``, output in ``x``'s dtype; ``product``
    takes the rows in ``compute``."""

    kind = ""
    compute = COMPUTE

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(self.compute)
        y = self.product(rows).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights={self.kind}"
