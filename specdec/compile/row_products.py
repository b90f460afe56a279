"""One-row products of half-precision and int8 linear layers, compiled as streaming loops.

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
The same holds for attention at one query row: the CPU flash-attention kernel
(``F.scaled_dot_product_attention``) spends ~0.2 ms a layer on a one-row query
over a few hundred cached slots, in per-block matrix-vector calls, which was a
third of SmolLM2's bf16 step with its products streamed (18.4 → 13.9 ms with
one-row attention as loops); ``install`` marks the
module's layers so that, traced at one query row on CPU, specdec's SDPA
attention computes ``softmax(q·Kᵀ·scale + mask)·V`` in fp32 as two fused loops
(``one_row_attention``, registered once in transformers' ``AttentionInterface``
in place of specdec's own SDPA, ``specdec.model.attention``, which it is
everywhere else).
Both loops read their one row again for every output (every cached slot),
and inductor inlines pointwise work into the loops that read it, so each
row is first written to a buffer of its own (``materialized``): otherwise a
norm was recomputed beside every weight row and the query's rotary embedding
for every slot (SmolLM2's bf16 step 14.2 → 12.4 ms, medians of one process).
Weight-only int8 layers (``specdec.model.quantize``, ``--weights int8``) take
the same one-row loop over their int8 weights, each output's sum times its
scale (``int8_row_product``), where ``_weight_int8pack_mm`` read a one-row
product's weights at ~9 GB/s; their model's attention is marked as above.
Every sum these loops take runs over at most ``CHUNK`` elements (``chunked_sum``):
inductor sums a longer fp32 reduction through a cascade helper, which ran an
int8 one-row product over 4,864 inputs (the MLP's down projection of a
Qwen2.5-0.5B shape) at 3.5 GB/s, 22-27 GB/s split (bf16: 13 against 50-58,
in cache); a longer one is split into equal chunks, each summed as a loop of
its own, then the partial sums added.
``SPECDEC_COMPILE_ROW_PRODUCTS`` (auto, the default, or on: installed on CPU;
off: never) is read where the graphs are set up (``specdec.compile.fixed_graphs``).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from specdec.model import attention
from specdec.model.quantize import Int8Linear
from specdec.model.w8a8 import W8A8Linear

HALF = (torch.bfloat16, torch.float16)
CHUNK = 4096                    # the longest sum inductor's CPU loops take without their cascade helper
MIN_CHUNK = 256                 # a length with no divisor into chunks at least this long is summed whole
MARK = "_one_row_attention"     # set on the modules of a model ``install`` took


def one_row(x: torch.Tensor) -> bool:
    """Whether ``x`` [..., in] is one row at a shape known while tracing (a
    free batch dimension is a symbol, never 1)."""
    return all(type(d) is int and d == 1 for d in x.shape[:-1])     # (a symbol's value never read)


def row_product_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer's forward, as a multiply-and-sum where a traced graph takes one row (module doc)."""
    if not (torch.compiler.is_compiling() and x.device.type == "cpu" and one_row(x)):
        return F.linear(x, self.weight, self.bias)
    y = chunked_sum(materialized(x.float()).unsqueeze(-2) * self.weight.float())
    if self.bias is not None:
        y = y + self.bias.float()
    return y.to(x.dtype)


def chunks(n: int) -> int:
    """Into how many equal chunks of at most ``CHUNK`` a sum of ``n`` elements
    splits: the fewest that divide it (1 where ``n <= CHUNK``, or where only
    chunks shorter than ``MIN_CHUNK`` would)."""
    k = -(-n // CHUNK)
    while n % k:
        k += 1
    return k if k == 1 or n // k >= MIN_CHUNK else 1


def chunked_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x.sum(dim)``, as sums of at most ``CHUNK`` elements then their sum (module doc)."""
    dim = dim % x.dim()
    n = x.shape[dim]
    k = chunks(n) if type(n) is int else 1
    return x.sum(dim) if k == 1 else x.unflatten(dim, (k, n // k)).sum(dim + 1).sum(dim)


def materialized(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values in a buffer of their own within a compiled graph. Inductor
    inlines a pointwise expression into each loop that reads it, and the loops
    here read their one row once per output: a product's input (a norm, an
    embedding lookup) would be computed again for every output row beside the
    weight it multiplies, and the query's rotary embedding (a cosine and a sine
    an element) again for every cached slot the score loop visits. A scatter is
    always written out; copying into it is exact."""
    return torch.zeros_like(x).index_copy(-1, torch.arange(x.shape[-1], device=x.device), x)


def one_row_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      **kwargs):
    """specdec's SDPA attention (``specdec.model.attention``), but for a marked layer traced at one
    query row on CPU: query [B, H, 1, D], key/value [B, Hkv, C, D] (H a
    multiple of Hkv), the mask additive or boolean (True: attend) over the
    first C slots; returns [B, 1, H, D] in the query's dtype, as SDPA does."""
    if not (vars(module).get(MARK) and torch.compiler.is_compiling() and query.device.type == "cpu"
            and all(type(d) is int for d in (*query.shape, *key.shape)) and query.shape[2] == 1
            and not dropout and all(kwargs.get(name) is None for name in ("position_bias", "softcap", "s_aux"))):
        return attention.sdpa_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    b, heads, _, d = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    q = materialized(query.float().reshape(b, kv_heads, groups, 1, d))
    scores = (q * key.float()[:, :, None]).sum(-1) * (d ** -0.5 if scaling is None else scaling)   # [B, Hkv, g, C]
    if attention_mask is not None:
        mask = attention_mask[:, :, :, :slots]
        mask = mask.reshape(mask.shape[0], *((kv_heads, groups) if mask.shape[1] == heads else (1, 1)), slots)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    # softmax over the slots, its sums (and the weighted sum of the values) in chunks: a long cache
    # (over CHUNK slots) would take inductor's cascade helper
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    weights = weights / chunked_sum(weights)[..., None]
    out = chunked_sum(weights[..., None] * value.float()[:, :, None], -2)                        # [B, Hkv, g, D]
    return out.reshape(b, 1, heads, d).to(query.dtype), None


def int8_row_product(self: Int8Linear, rows: torch.Tensor) -> torch.Tensor:
    """The int8 layer's product (``specdec.model.quantize``: rows [N, in] in
    bfloat16), as a multiply-and-sum over its int8 weights where a traced graph
    takes one row: each output the fp32 sum of its products times its scale,
    rounded once, as ``_weight_int8pack_mm`` computes it (in another order)."""
    if not (torch.compiler.is_compiling() and rows.device.type == "cpu" and one_row(rows)):
        return Int8Linear.product(self, rows)
    y = chunked_sum(materialized(rows.float()).unsqueeze(-2) * self.qweight.float()) * self.scales.float()
    return y.to(rows.dtype)


def takes(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a linear layer whose one-row product ``install``
    rewrites: a half-precision one, or an int8 one (whatever the model's dtype:
    its product runs in bfloat16)."""
    if type(module) is Int8Linear:
        return module.qweight.device.type == "cpu" and module.qweight.is_contiguous()
    return (type(module) is torch.nn.Linear and module.weight.dtype in HALF
            and module.weight.device.type == "cpu" and module.weight.is_contiguous())


ROW_FORWARDS = {torch.nn.Linear: ("forward", row_product_forward), Int8Linear: ("product", int8_row_product)}


def install(module: torch.nn.Module) -> int:
    """Give every linear layer of ``module`` that ``takes`` the streaming
    one-row forward (once: a layer that has it keeps it); how many layers have it.
    The attention of a module with such layers, or with w8a8 ones (whose kernel
    streams a row as it is, ``specdec.model.w8a8``), is marked for the one-row loops."""
    count = 0
    for layer in module.modules():
        if not takes(layer):
            continue
        name, forward = ROW_FORWARDS[type(layer)]
        if getattr(layer.__dict__.get(name), "__func__", None) is not forward:
            setattr(layer, name, types.MethodType(forward, layer))
        count += 1
    if count or any(isinstance(layer, W8A8Linear) for layer in module.modules()):
        if AttentionInterface._global_mapping.get(attention.IMPLEMENTATION) is not one_row_attention:
            AttentionInterface.register(attention.IMPLEMENTATION, one_row_attention)
        for layer in module.modules():
            vars(layer)[MARK] = True
    return count


def uninstall(module: torch.nn.Module) -> None:
    """Give back every linear layer of ``module`` its own forward."""
    for layer in module.modules():
        for name, forward in ROW_FORWARDS.values():
            if getattr(layer.__dict__.get(name), "__func__", None) is forward:
                delattr(layer, name)
        vars(layer).pop(MARK, None)
