"""Target-side sampling: parameters, the filtered target distribution, draws.

`target_probs` turns verifier logits into the distribution the target model
would sample from in plain decoding (temperature, then top-k, then top-p
nucleus filtering, renormalised). Speculative acceptance is lossless with
respect to *this* distribution, so the same function must be used by plain
decoding and by the verifier.

All randomness flows through an explicit `torch.Generator` so that a seed
reproduces a whole generation; see `make_generator`.
"""

from __future__ import annotations

import os

import torch

from specdec.params import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Filtered target distribution, fp32, same shape as `logits` [..., V].

    Greedy params give the one-hot of the argmax (first index on ties), so
    that sampling-based code paths reduce exactly to greedy decoding.
    """
    params.validate()
    logits = logits.float()
    vocab = logits.shape[-1]
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()

    scaled = logits / params.temperature
    if 0 < params.top_k < vocab:
        # topk keeps exactly k entries even when values tie at the boundary.
        top_vals, top_idx = scaled.topk(params.top_k, dim=-1)
        scaled = torch.full_like(scaled, float("-inf")).scatter_(-1, top_idx, top_vals)
    probs = torch.softmax(scaled, dim=-1)

    if params.top_p < 1.0:
        sorted_p, sorted_idx = probs.sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p  # [..., V] mass ranked above each token
        # The top token has mass_before == 0 < top_p, so it always survives.
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, sorted_idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from `probs` [V] (need not be normalised) using `generator`."""
    probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator))


def make_generator(seed: int | None = None, device: str | torch.device = "cpu") -> torch.Generator:
    """A seeded generator; with seed=None a fresh seed is drawn from os.urandom.

    The seed actually used is `generator.initial_seed()`, so a run started
    without a seed can still be logged and replayed. Draws reproduce only on
    the same generator device.
    """
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") >> 1  # 63 bits: fits int64
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator
