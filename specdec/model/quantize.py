"""Weight-only quantized linear layers on CPU (``--weights int8|int4``; ``w8a8``: ``specdec.model.w8a8``).

A model loaded with ``ModelSpec.weights`` other than ``dtype`` has every
``nn.Linear`` (the decoder's projections and the output head; a tied head gets
its own quantized copy, the input embedding stays a lookup in the model's
dtype) replaced by a module that holds its weight quantized and multiplies
through torch's own CPU kernels:

- ``int8``: per-output-channel symmetric, ``q = round(w / s)`` in [-127, 127]
  with ``s = max|w| / 127`` per row; ``torch.ops.aten._weight_int8pack_mm``.
- ``int4``: groups of ``GROUP`` (32, a GGUF Q4_1 block) along the input, each
  with a scale and a minimum, ``q = round((w - min) / s)`` in [0, 15], packed
  by ``_convert_weight_to_int4pack_for_cpu`` and multiplied by
  ``_weight_int4pack_mm_for_cpu`` (which reads ``(q - 8) * s + zero``, so
  ``zero = min + 8 s``). A layer the kernel cannot take (its output width not a
  multiple of 16, its input width not a multiple of the group) is held in int8
  instead, named in one log line.

Both kernels run in bfloat16 (fp32 accumulation): their fp32 paths are 10-50x
slower than a dense fp32 product here (``docs/models.md``, "Quantized
weights"), so an fp32 model's activations are rounded to bfloat16 at each
quantized layer's input and its output cast back. Plain decoding and every
verify width run the same kernels over the same weights: speculation is
greedy-identical to plain decoding of the same quantized model up to
near-ties of the head's bf16 output, as in bfloat16 (``docs/models.md``,
"Quantized weights"), and sampled output is distributed as that model.

A prompt is the one place this differs: ``_weight_int8pack_mm`` costs grow
with the rows (at 128 rows it is 2-3x slower than a bfloat16 matrix product
of the same shape), so inside ``prompt_products`` (a prefill's causal span of
at least ``PROMPT_ROWS`` tokens, ``verifier.target``) an int8 layer converts
its weights to bfloat16 (exactly: |q| <= 127) and multiplies with the dense
kernel, then scales each output (two roundings to bfloat16 where the packed
kernel has one). Trees and one-token steps never run there, so plain decoding
and speculation read the same prompt K/V and stay as identical as above.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from specdec.model import w8a8
from specdec.model.quantized_linear import COMPUTE, QuantizedLinear, int8_codes

log = logging.getLogger(__name__)

GROUP = 32                              # int4 group along the input (GGUF Q4_1's block)
PROMPT_ROWS = 32                        # a prompt this long or longer: int8 products as dense bf16 ones
_PROMPT = contextvars.ContextVar("specdec_prompt_products", default=False)


@contextmanager
def prompt_products():
    """Products over a prompt's rows: an int8 layer multiplies ``PROMPT_ROWS``
    rows or more through the dense bfloat16 kernel (module docstring)."""
    token = _PROMPT.set(True)
    try:
        yield
    finally:
        _PROMPT.reset(token)


def has_int8(model: nn.Module) -> bool:
    """Whether ``model`` holds int8 layers (whose prompts ``prompt_products`` speeds up)."""
    return any(type(m) is Int8Linear for m in model.modules())


class Int8Linear(QuantizedLinear):
    """Per-output-channel symmetric int8 weights (``_weight_int8pack_mm``)."""

    kind = "int8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias)
        qweight, scale = int8_codes(weight)
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scale.to(COMPUTE))

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] >= PROMPT_ROWS and _PROMPT.get() and not torch.compiler.is_compiling():
            return (rows @ self.qweight.to(rows.dtype).t()) * self.scales
        return torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]


class Int4Linear(QuantizedLinear):
    """Groupwise asymmetric int4 weights, a scale and a minimum per ``group``
    inputs (``_weight_int4pack_mm_for_cpu``)."""

    kind = "int4"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, group: int = GROUP) -> None:
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, bias)
        self.group = group
        w = weight.detach().float().reshape(out_features, in_features // group, group)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scale = ((high - low) / 15).clamp(min=1e-12)
        q = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.reshape(out_features, in_features).contiguous(), 1))
        # [in / group, out, 2]: the scale and the zero (the value code 8 stands for)
        self.register_buffer("scales_zeros", torch.stack([scale, low + 8 * scale], dim=-1)
                             .transpose(0, 1).contiguous().to(COMPUTE))

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.qweight, self.group, self.scales_zeros)

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel multiplies by, [out, in] in fp32 (through the kernel itself)."""
        eye = torch.eye(self.in_features, dtype=COMPUTE)
        return self.product(eye).float().t()


def int4_fits(out_features: int, in_features: int, group: int = GROUP) -> bool:
    """Whether torch's int4 CPU packing takes a [out, in] weight."""
    return out_features % 16 == 0 and in_features % group == 0


def quantize_linears(model: nn.Module, weights: str, keep: tuple[str, ...] = ()) -> dict[str, str]:
    """Replace every ``nn.Linear`` of ``model`` (but those named in ``keep``) by its
    ``weights`` (int8|int4|w8a8) quantized form, in place; returns each replaced
    layer's name -> kind. A tied output head is quantized from the shared weight,
    which the input embedding keeps."""
    if weights == "dtype":
        return {}
    done: dict[int, QuantizedLinear] = {}
    kinds: dict[str, str] = {}
    fallback: list[str] = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is not nn.Linear or full in keep:
                continue
            if id(child) not in done:
                done[id(child)] = quantized(child, weights)
                if weights != "int8" and done[id(child)].kind == "int8":
                    fallback.append(f"{full} [{child.out_features}x{child.in_features}]")
            setattr(module, child_name, done[id(child)])
            kinds[full] = done[id(child)].kind
    if fallback:
        need = ("torch's int4 packing needs the output width a multiple of 16 and the input width a multiple of "
                f"{GROUP}" if weights == "int4" else f"the w8a8 kernel needs the input width a multiple of {w8a8.BLOCK}")
        log.warning("%s weights: %d layer(s) held in int8 (weight-only) instead (%s): %s", weights, len(fallback),
                    need, ", ".join(fallback))
    log.info("weights: %d linear layers quantized (%s)", len(kinds), weights)
    return kinds


def quantized(linear: nn.Linear, weights: str) -> QuantizedLinear:
    if weights == "int4" and int4_fits(linear.out_features, linear.in_features):
        return Int4Linear(linear.weight, linear.bias)
    if weights == "w8a8" and w8a8.fits(linear.in_features):
        return w8a8.W8A8Linear(linear.weight, linear.bias)
    return Int8Linear(linear.weight, linear.bias)


def compute_dtype(model: nn.Module, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``model``'s linear layers multiply in: ``COMPUTE`` once quantized, else
    ``dtype`` (w8a8 layers too: rounding their activations to int8 codes moves an output
    as far as bfloat16 does, so they are checked with its tolerances)."""
    return COMPUTE if any(isinstance(m, QuantizedLinear) for m in model.modules()) else dtype


def weights_key(model: nn.Module) -> str:
    """The quantized layers of ``model`` by name and kind, and the code of this module
    (and of w8a8's, where it holds such layers) ('' for none): part of a compiled package's key."""
    kinds = ";".join(f"{name}:{m.kind}" for name, m in model.named_modules() if isinstance(m, QuantizedLinear))
    sources = (__file__, w8a8.__file__, w8a8.SOURCE) if ":w8a8" in kinds else (__file__,)
    code = b"".join(Path(f).read_bytes() for f in sources)
    return kinds and hashlib.sha256(code).hexdigest()[:8] + kinds


@contextmanager
def shared_weight_lowerings():
    """While a package over shared weights is built (``specdec.compile.aot``):
    inductor's lowering of the int4 product adds its group size as a graph
    constant of its own, which such a package would then ask the model for;
    the product is called as the aten kernel it is instead (a fallback)."""
    from torch._inductor import lowering

    op = torch.ops.aten._weight_int4pack_mm_for_cpu.default
    saved = lowering.lowerings.get(op)
    lowering.lowerings[op] = lowering.fallback_handler(op, add_to_fallback_set=False)
    try:
        yield
    finally:
        if saved is None:
            lowering.lowerings.pop(op, None)
        else:
            lowering.lowerings[op] = saved
