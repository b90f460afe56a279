"""The memory floor of a one-token step: how close ``bench profile``'s steps come to it.

Plain decoding of a model that does not fit in cache is memory-bound: each
one-token step streams every weight it multiplies once (the linear layers and
the output head; the input embedding only gives up one row per token, unless
it *is* the output head), and no kernel can run faster than the device streams
those bytes. This module measures the device's streaming bandwidth at the run's
thread count (a sum over a buffer larger than any cache, the best of several
runs) and reports, for the profiled steps:

- ``weight_bytes``: the bytes a step streams (each distinct tensor once: a
  tied head counts once, a quantized model's packed weights and scales as
  stored);
- ``stream_gb_s``: the measured bandwidth; ``floor_ms`` = bytes / bandwidth;
- per path, ``step_ms`` and ``of_floor`` = floor / step (1.0: at the floor);
- ``floor_tokens_per_s`` at each dtype's bytes (float32, bfloat16): what any
  engine decoding the same weights one token at a time can reach here, a
  peer included. A peer at its float32 floor can be beaten ``r`` times by
  plain decoding only with ``r`` times fewer bytes a token; past that, only
  speculation (several tokens a weight read) goes further.

The K/V cache a step reads (``prefix`` tokens) is left out: at the profile's
prefixes it is under 2% of a real model's weights.
"""

from __future__ import annotations

import time

import torch

from specdec.model.loading import stored_tensors
from specdec.model.quantize import QuantizedLinear

MIN_STREAM_BYTES = 256 << 20     # a buffer no cache holds (this host's last level: 32 MiB)
STREAM_RUNS = 7


def lookup_only(model: torch.nn.Module) -> set[int]:
    """The input embedding's tensors (by ``data_ptr``) that a step only looks
    a row up in: all of them, unless the output head shares them (tied)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is None:
        return set()
    heads = set() if head is None else {t.data_ptr() for t in (*head.parameters(), *head.buffers())}
    return {t.data_ptr() for t in (*embed.parameters(), *embed.buffers())} - heads


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a one-token step streams: every distinct stored tensor once, but
    the input embedding's table (one row read per token) unless the output
    head shares it."""
    skip = lookup_only(model)
    return sum(t.numel() * t.element_size() for t in stored_tensors(model) if t.data_ptr() not in skip)


def matmul_parameters(model: torch.nn.Module) -> int:
    """Weights a token multiplies, in elements (as ``weight_bytes`` counts them;
    a quantized linear layer (``specdec.model.quantize``) as its in x out
    weights): the floor of another dtype's step is this times its element size."""
    skip = lookup_only(model) | {t.data_ptr() for t in model.buffers()}
    quantized = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, QuantizedLinear))
    return quantized + sum(t.numel() for t in stored_tensors(model) if t.data_ptr() not in skip)


@torch.inference_mode()
def stream_bandwidth(device: torch.device, nbytes: int = MIN_STREAM_BYTES, runs: int = STREAM_RUNS) -> float:
    """GB/s of a float32 sum over ``nbytes`` (at least ``MIN_STREAM_BYTES``) on
    ``device``, the best of ``runs`` (the first touches the pages)."""
    n = max(nbytes, MIN_STREAM_BYTES) // 4
    buffer = torch.ones(n, dtype=torch.float32, device=device)
    cuda = device.type == "cuda"
    best = float("inf")
    for _ in range(runs + 1):
        if cuda:
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        buffer.sum()
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return n * 4 / best / 1e9


def roofline(model: torch.nn.Module, steps: dict[str, float], bandwidth: float | None = None) -> dict:
    """The record: ``steps`` {path: one-token step ms} against the floor of
    ``model``'s weights at ``bandwidth`` GB/s (None: measured here)."""
    device = next(model.parameters()).device
    nbytes = weight_bytes(model)
    if bandwidth is None:
        bandwidth = stream_bandwidth(device, 2 * nbytes)
    floor_ms = nbytes / bandwidth / 1e6
    params = matmul_parameters(model)
    return {"weight_bytes": nbytes, "stream_gb_s": round(bandwidth, 2), "floor_ms": round(floor_ms, 3),
            "steps": {path: {"step_ms": round(ms, 3), "of_floor": round(floor_ms / ms, 3)}
                      for path, ms in steps.items()},
            "floor_tokens_per_s": {dtype: round(bandwidth * 1e9 / (params * size), 1)
                                   for dtype, size in (("float32", 4), ("bfloat16", 2))}}


def markdown(record: dict) -> list[str]:
    """Lines for the profile's report."""
    floors = ", ".join(f"{dtype} {tps:.1f}" for dtype, tps in record["floor_tokens_per_s"].items())
    lines = ["", f"Memory floor of a one-token step: {record['weight_bytes'] / 1e6:.1f} MB of weights at "
             f"{record['stream_gb_s']:.1f} GB/s streamed = {record['floor_ms']:.2f} ms "
             f"(tokens/s at the floor, one token a step: {floors})", "",
             "| path | target_step ms | floor ÷ step |", "|---|---:|---:|"]
    for path, s in record["steps"].items():
        lines.append(f"| {path} | {s['step_ms']:.2f} | {s['of_floor']:.2f} |")
    return lines
