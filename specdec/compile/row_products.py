"""One-row products of half-precision linear layers, compiled as streaming loops.

A one-token step (plain decoding, a draft model's step, a head's root)
multiplies one row by every weight of the model, so on a CPU its time is the
time it takes to read the weights. The BLAS call for a bfloat16 row (oneDNN)
reads them at 10–16 GB/s on the EPYC host of docs/models.md, where one core
streams ~35 GB/s; the same product written as a multiply-and-sum over each
output's inputs in fp32 becomes, in a compiled graph, one vectorised loop per
layer that reads each weight once, at 20–32 GB/s (SmolLM2-135M in bfloat16:
a compiled step 28.9 → 18.4 ms, docs/models.md "One-row products").

``install`` gives every half-precision ``nn.Linear`` of a module whose weight
lies output-major (transformers' layout: each output's inputs contiguous) a
forward that takes this form while a graph is traced (``torch.export`` or
``torch.compile``) at a static one-row shape on CPU; eagerly, and at any other
shape, it is the layer's own product. Each output is the fp32 sum of its
products rounded once to the layer's dtype, as the BLAS call computes it,
summed in another order: a one-row step and a tree verify (a BLAS call at 16
rows) of the same weights may differ in the last bit, as they already may in
half precision (near-tie flips: docs/models.md "The guarantee").
``SPECDEC_COMPILE_ROW_PRODUCTS`` (auto, the default, or on: installed on CPU;
off: never) is read where the graphs are set up (``specdec.compile.fixed_graphs``).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

HALF = (torch.bfloat16, torch.float16)


def one_row(x: torch.Tensor) -> bool:
    """Whether ``x`` [..., in] is one row at a shape known while tracing (a
    free batch dimension is a symbol, never 1)."""
    return all(type(d) is int and d == 1 for d in x.shape[:-1])     # (a symbol's value never read)


def row_product_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer's forward, as a multiply-and-sum where a traced graph takes one row (module doc)."""
    if not (torch.compiler.is_compiling() and x.device.type == "cpu" and one_row(x)):
        return F.linear(x, self.weight, self.bias)
    y = (x.unsqueeze(-2).float() * self.weight.float()).sum(-1)
    if self.bias is not None:
        y = y + self.bias.float()
    return y.to(x.dtype)


def takes(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a linear layer whose one-row product ``install`` rewrites."""
    return (type(module) is torch.nn.Linear and module.weight.dtype in HALF
            and module.weight.device.type == "cpu" and module.weight.is_contiguous())


def install(module: torch.nn.Module) -> int:
    """Give every linear layer of ``module`` that ``takes`` the streaming
    one-row forward (once: a layer that has it keeps it); how many layers have it."""
    count = 0
    for layer in module.modules():
        if not takes(layer):
            continue
        if getattr(layer.__dict__.get("forward"), "__func__", None) is not row_product_forward:
            layer.forward = types.MethodType(row_product_forward, layer)
        count += 1
    return count


def uninstall(module: torch.nn.Module) -> None:
    """Give back every linear layer of ``module`` its own forward."""
    for layer in module.modules():
        if getattr(layer.__dict__.get("forward"), "__func__", None) is row_product_forward:
            del layer.forward
