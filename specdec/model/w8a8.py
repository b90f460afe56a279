"""Int8 weights times int8 activations on CPU (``--weights w8a8``): k rows for the price of one.

A tree verify multiplies k rows by every weight. With weight-only int8
(``--weights int8``) each row past the first costs about what the first does,
because the kernels convert every weight to a float for every row (a 16-node
verify of SmolLM2 costs 6.6 one-token steps compiled, docs/models.md), so trees
stop paying. Here the activations are quantized too, as GGUF's Q8_0 does:
each row's inputs in blocks of ``BLOCK`` (32), a scale per block
(``amax / 127``, codes rounded to nearest even), and every block's products
summed in int32 by AVX512-VNNI (64 products an instruction, the weights
converted never). The weights are ``Int8Linear``'s (a scale per output row),
packed once for the kernel (``pack``).

Exact and batch-invariant. A block's sum is an integer, exact in any order;
the blocks' sums are scaled and added in fp32 in block order, then times the
output's scale, the same operations for every row whatever the number of
rows and whichever path computes them (the VNNI loops, or the portable ones
where the CPU lacks VNNI). So a one-token step and a tree verify give the
same products for the same row, bit for bit, and greedy speculation over
such a model is token-identical to its plain decoding wherever the rest of
the forward is (attention, norms: docs/models.md "The guarantee").

Accuracy: on 40 held-out SmolLM2 conversations (~11,000 positions, against
the fp32 model, this arithmetic simulated in fp32) the argmax agreed at 96.6% (weight-only int8: 96.7%; int8
activations with one scale per row instead of per block: 91.9%), a KL of
0.0065 nats (0.0046).

The kernel (``w8a8.cpp``) is built once per machine on first use
(~25 s, torch's C++ extension cache) and registered as
``torch.ops.specdec.w8a8_linear``, which compiled graphs and AOTInductor
packages call as an external kernel.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

from specdec.model.quantized_linear import QuantizedLinear, int8_codes

log = logging.getLogger(__name__)

BLOCK = 32                       # inputs per activation scale (the kernel's, w8a8.cpp)
COLS = 16                        # outputs per packed column block
SOURCE = Path(__file__).with_name("w8a8.cpp")
# auto (default): the VNNI loops where the CPU has them; portable: never (the same values, slower)
KERNEL_ENV, KERNEL_MODES = "SPECDEC_W8A8_KERNEL", ("auto", "portable")
_lock = threading.Lock()
_loaded = False


def load_kernel() -> None:
    """Build (once per machine and source) and load ``torch.ops.specdec.w8a8_linear``."""
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        from torch.utils.cpp_extension import load_inline

        if shutil.which("ninja") is None:       # the ninja wheel's (a dependency), outside an activated venv
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        source = SOURCE.read_text()
        name = "specdec_w8a8_" + hashlib.sha256(source.encode()).hexdigest()[:12]
        log.info("w8a8: loading the int8 kernel (built on first use, ~25 s)")
        load_inline(name=name, cpp_sources=[source], is_python_module=False,
                    extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"])
        torch.library.register_fake("specdec::w8a8_linear")(_fake)
        _loaded = True


def _fake(x, packed, scales, n, vnni):
    return x.new_empty(x.shape[0], n)


def use_vnni() -> bool:
    mode = os.environ.get(KERNEL_ENV, "auto")
    if mode not in KERNEL_MODES:
        raise ValueError(f"{KERNEL_ENV} must be one of {', '.join(KERNEL_MODES)}, got {mode!r}")
    return mode == "auto"


def fits(in_features: int) -> bool:
    """Whether the kernel takes a layer of ``in_features`` inputs (whole blocks)."""
    return in_features % BLOCK == 0


def pack(qweight: torch.Tensor) -> torch.Tensor:
    """int8 weights [out, in] as the kernel reads them: [ceil(out/16), in/4, 16, 4]
    (16 outputs' four consecutive inputs a 64-byte row), each code stored as the
    unsigned byte ``w + 128`` (VNNI multiplies unsigned bytes by signed ones:
    the kernel takes the activations' codes as the signed side and subtracts
    128 × their block sum, ``w8a8.cpp``)."""
    out_features, in_features = qweight.shape
    blocks = -(-out_features // COLS)
    padded = torch.zeros(blocks * COLS, in_features, dtype=torch.int16)
    padded[:out_features] = qweight
    unsigned = (padded + 128).to(torch.uint8).view(torch.int8)       # the bytes w + 128
    return unsigned.view(blocks, COLS, in_features // 4, 4).permute(0, 2, 1, 3).contiguous()


class W8A8Linear(QuantizedLinear):
    """Per-output-channel symmetric int8 weights (``Int8Linear``'s), activations
    quantized per row and block of 32 at each call (module docstring)."""

    kind = "w8a8"
    compute = torch.float32     # the kernel quantizes fp32 rows

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        out_features, in_features = weight.shape
        if not fits(in_features):
            raise ValueError(f"w8a8 needs the input width a multiple of {BLOCK}, got {in_features}")
        super().__init__(in_features, out_features, bias)
        load_kernel()
        qweight, scale = int8_codes(weight)
        packed = pack(qweight)
        self.register_buffer("packed", packed)
        padded = torch.zeros(packed.shape[0] * COLS)
        padded[:out_features] = scale
        self.register_buffer("scales", padded)
        self.vnni = use_vnni()

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.specdec.w8a8_linear(rows, self.packed, self.scales, self.out_features, self.vnni)

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] in fp32 (codes times scales)."""
        blocks = self.packed.shape[0]
        unsigned = self.packed.view(torch.uint8).permute(0, 2, 1, 3).reshape(blocks * COLS, self.in_features)
        return ((unsigned.float() - 128) * self.scales[:, None])[:self.out_features]
