"""Compiled target forwards over a fixed-shape KV view (``--compile``).

An eager forward of a small model is mostly per-operator dispatch and Python
(``specdec bench profile`` measures the share). ``torch.compile`` (inductor)
removes it only if the shapes stop changing from one step to the next, so the
compiled path never lets them change, as gpt-fast does with a static cache:

- the cache: a session's in-place cache (``specdec.kv.SlabLayer``) allocated
  once at a *capacity bucket* (a power of two >= 512 slots), zero-filled, so
  every step sees K/V buffers [1, heads, C, d] of one shape;
- the writes: the step writes its n new K/V into slots [L, L + n) of those
  buffers with ``index_copy_`` (``FixedLayer``), slot indices as a tensor, so
  the length L is data, not shape; the cache length moves afterwards, outside;
- the mask: the forward's additive mask [1, 1, n, L + n] (tree or causal, per
  layer type for windowed models) padded to [1, 1, nb, C] with the dtype's
  minimum: slots past the length are invisible (they are zeros, never NaN);
- the width: n is padded up to the next of ``WIDTHS`` (1, 2, 4, ... 64); pad
  queries see only their own slot and their outputs are dropped. One graph per
  (width, capacity) pair: those of a default-sized tree at the smallest
  capacity are compiled at start-up (``STARTUP_WIDTHS``), others on first use.

Prefill (a causal forward of several tokens) and batched verification stay eager. A model that
fails to compile, or whose compiled logits differ from its eager ones on a
check at load, runs eagerly with one log line saying why (``compile_target``).
With ``auto`` the compiled path is also timed against the eager one on a
one-token step and kept only where it pays.

On CUDA the same code path would take ``mode="reduce-overhead"`` (CUDA graphs
over the same fixed shapes); that is not exercised on this project's machines.
"""

from __future__ import annotations

import functools
import logging
import time

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specdec import kv
from specdec.causal_lm import CausalLm
from specdec.knobs import DEFAULT_TOTAL_TOKENS
from specdec.masks import causal_allowed
from specdec.models import COMPILE_MODES

log = logging.getLogger(__name__)

WIDTHS = (1, 2, 4, 8, 16, 32, 64)      # compiled query widths; a forward is padded up to the next one
MIN_CAPACITY = 512                      # capacity buckets: powers of two from here (one for most sessions)
PAYS = 0.9                              # auto: compiled must take at most this share of the eager step time
# compiled at start-up: every width a default-sized tree pads to (larger trees compile on first use)
ALIBI_REASON = "ALiBi models run their own blocks with per-row biases (specdec.alibi), not one fixed-shape forward"
STARTUP_WIDTHS = tuple(w for w in WIDTHS if w <= DEFAULT_TOTAL_TOKENS)


def capacity_bucket(slots: int) -> int:
    """The fixed capacity a cache reserving ``slots`` gets: a power of two >= MIN_CAPACITY."""
    c = MIN_CAPACITY
    while c < slots:
        c *= 2
    return c


def width_bucket(n: int) -> int | None:
    return next((w for w in WIDTHS if w >= n), None)


class FixedLayer(CacheLayerMixin):
    """One layer's K/V buffers [1, heads, C, d] inside a compiled forward:
    ``update`` writes the new K/V at ``slots`` [n] and returns the whole buffers."""

    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.slots = keys, values, slots
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.slots, key_states)
        self.values.index_copy_(2, self.slots, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.keys.shape[2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]


def pad_mask(mask: torch.Tensor, width: int, capacity: int) -> torch.Tensor:
    """An additive mask [B, 1, n, L + n] as [B, 1, width, capacity]: unseen
    slots get the dtype's minimum; pad query j (j >= n) sees only slot L + j."""
    B, _, n, k = mask.shape
    out = mask.new_full((B, 1, width, capacity), torch.finfo(mask.dtype).min)
    out[:, :, :n, :k] = mask
    pads = torch.arange(n, width)
    out[:, :, pads, k - n + pads] = 0
    return out


class CompiledForward:
    """``torch.compile`` of one causal LM's forward over fixed-shape caches."""

    def __init__(self, lm: CausalLm):
        self.lm = lm
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.layer_shapes = self._probe()
        self.cache_keyword = kv.cache_keyword(type(lm.body).forward)     # looked up outside the traced forward
        self.step = torch.compile(self._forward, dynamic=False)

    @torch.inference_mode()
    def _probe(self) -> list[tuple[int, int]]:
        """(KV heads, head dim) of every layer, from a one-token eager forward."""
        cache = self.lm.new_cache(1)
        self.lm.hidden(cache, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), None)
        return [(layer.keys.shape[1], layer.keys.shape[3]) for layer in cache.layers]

    def new_cache(self, capacity: int = 0):
        """A session cache of ``capacity_bucket(capacity)`` zeroed slots per layer."""
        size = capacity_bucket(capacity)
        cache = self.lm.new_cache()
        with torch.inference_mode():
            for i, (heads, dim) in enumerate(self.layer_shapes):
                shape = (1, heads, size, dim)
                kv.adopt(cache, i, torch.zeros(shape, dtype=self.lm.dtype, device=self.lm.device),
                         torch.zeros(shape, dtype=self.lm.dtype, device=self.lm.device), 0)
        return cache

    def _forward(self, tokens, positions, mask, slots, keys, values):
        """tokens, positions [1, nb]; mask [1, 1, nb, C] (or per layer type);
        slots [nb]; keys, values: per layer [1, heads, C, d], written in place."""
        cache = Cache(layers=[FixedLayer(k, v, slots) for k, v in zip(keys, values)])
        hidden = self.lm.body(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True,
                              **{self.cache_keyword: cache}).last_hidden_state
        return hidden.float(), self.lm.logits(hidden)

    def accepts(self, cache, n: int) -> bool:
        """Whether a forward of n tokens on ``cache`` takes the compiled path."""
        layers = getattr(cache, "layers", None)
        if not layers or not all(isinstance(layer, kv.SlabLayer) for layer in layers):
            return False
        k, _ = layers[0].buffers
        width = width_bucket(n)
        return (k is not None and k.shape[0] == 1 and width is not None
                and k.shape[2] == capacity_bucket(k.shape[2]) and kv.seq_len(cache) + width <= k.shape[2])

    @torch.inference_mode()
    def forward(self, cache, tokens: torch.Tensor, positions: torch.Tensor, mask):
        """As ``CausalLm.hidden`` + ``logits`` for tokens, positions [1, n]:
        (features [1, n, H] fp32, logits [1, n, V]); None where the compiled
        path does not apply (the caller runs eagerly)."""
        n = tokens.shape[1]
        if (mask is None and n > 1) or not self.accepts(cache, n):
            return None                  # a prefill (causal, several tokens), or no fixed-shape cache
        past, width = kv.seq_len(cache), width_bucket(n)
        buffers = [layer.buffers for layer in cache.layers]
        capacity = buffers[0][0].shape[2]
        if mask is None:
            k_pos = torch.cat([torch.arange(past), positions[0].cpu()])[None]
            mask = self.lm.masks(causal_allowed(n, past)[None], positions.cpu(), k_pos)
        if isinstance(mask, dict):
            mask = {kind: pad_mask(m, width, capacity) for kind, m in mask.items()}
        else:
            mask = pad_mask(mask, width, capacity)
        dev = self.lm.device
        pad = width - n
        tokens = torch.cat([tokens.to(dev), tokens.new_zeros(1, pad, device=dev)], dim=1)
        positions = torch.cat([positions.to(dev), positions[:, -1:].to(dev).expand(1, pad)], dim=1)
        slots = torch.arange(past, past + width, device=dev)
        hidden, logits = self.step(tokens, positions, mask, slots, [b[0] for b in buffers], [b[1] for b in buffers])
        for i, (k, v) in enumerate(buffers):
            kv.adopt(cache, i, k, v, past + n)
        return hidden[:, :n], logits[:, :n]

    def warm(self, widths=WIDTHS, capacity: int = MIN_CAPACITY) -> float:
        """Compile the graphs for ``widths`` at one capacity ahead of traffic; seconds taken."""
        t = time.perf_counter()
        for width in widths:
            cache = self.new_cache(capacity)
            k_pos = torch.arange(width)[None]
            mask = self.lm.masks(causal_allowed(width, 0)[None], k_pos, k_pos)
            self.forward(cache, torch.zeros(1, width, dtype=torch.long), k_pos, mask)
        return time.perf_counter() - t


def eager_forward(lm: CausalLm, cache, tokens: torch.Tensor, positions: torch.Tensor, mask):
    """The eager forward ``CompiledForward.forward`` stands in for: (features fp32, logits)."""
    hidden = lm.hidden(cache, tokens, positions, mask)
    return hidden.float(), lm.logits(hidden)


@torch.inference_mode()
def check_compiled(compiled: CompiledForward) -> str | None:
    """Why the compiled forward cannot serve this model (None: it can): after
    an eager prefix, a one-token step and a 3-node tree must give the eager
    logits and leave the cache as long."""
    lm = compiled.lm
    vocab = int(lm.config.get_text_config(decoder=True).vocab_size)
    seq = torch.randint(0, vocab, (6,), generator=torch.Generator().manual_seed(0))
    ancestor = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    tree_pos = torch.tensor([5, 6, 6])
    tree = torch.stack([seq[5], seq[0], seq[1]])
    k_pos = torch.cat([torch.arange(5), tree_pos])[None]
    allowed = torch.cat([torch.ones(3, 5, dtype=torch.bool), ancestor], dim=1)[None]
    logits = {}
    for run, step in (("compiled", compiled.forward), ("eager", functools.partial(eager_forward, lm))):
        cache = compiled.new_cache(16)
        lm.hidden(cache, seq[None, :4], torch.arange(4)[None], None)
        one = step(cache, seq[None, 4:5], torch.tensor([[4]]), None)
        if one is None:
            return "a one-token step does not take the compiled path"
        tree_out = step(cache, tree[None], tree_pos[None], lm.masks(allowed, tree_pos[None], k_pos))
        if kv.seq_len(cache) != 8:
            return f"the {run} path left {kv.seq_len(cache)} cached slots, not 8"
        logits[run] = (one[1], tree_out[1])
    for got, want in zip(logits["compiled"], logits["eager"]):
        err = float((got - want).abs().max() / (1.0 + want.abs().max()))
        if not err <= (1e-4 if lm.dtype == torch.float32 else 5e-2):
            return f"compiled logits differ from eager ones (relative error {err:.2g})"
    return None


@torch.inference_mode()
def time_step(lm: CausalLm, step, cache, prefix: int = 64, repeats: int = 20) -> float:
    """Median ms of ``step`` on one token after an eager ``prefix`` (cut back after each run)."""
    lm.hidden(cache, torch.zeros(1, prefix, dtype=torch.long), torch.arange(prefix)[None], None)
    times = []
    for _ in range(repeats + 2):
        t = time.perf_counter()
        step(cache, torch.zeros(1, 1, dtype=torch.long), torch.tensor([[prefix]]), None)
        times.append(time.perf_counter() - t)
        kv.truncate(cache, prefix)
    return sorted(times[2:])[repeats // 2] * 1000


def compile_target(lm: CausalLm, mode: str) -> CompiledForward | None:
    """The compiled forward of ``lm`` for ``--compile MODE``, or None (eager):
    off; compilation or the check failed (one log line says why); or, with
    auto, a compiled one-token step is not faster than the eager one."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"--compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    if mode == "off":
        return None
    kind = getattr(lm.config, "model_type", "?")
    t = time.perf_counter()
    try:
        compiled = CompiledForward(lm)
        reason = check_compiled(compiled) if lm.alibi is None else ALIBI_REASON
        if reason is None:
            compiled.warm(STARTUP_WIDTHS)
    except Exception as exc:  # noqa: BLE001 - any failure means: run this model eagerly
        reason = f"compilation failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    if reason is not None:
        log.warning("compiled forwards off for model type %r: %s; running eagerly", kind, reason)
        return None
    if mode == "auto":
        eager_ms = time_step(lm, functools.partial(eager_forward, lm), compiled.new_cache(MIN_CAPACITY))
        compiled_ms = time_step(lm, compiled.forward, compiled.new_cache(MIN_CAPACITY))
        if compiled_ms > PAYS * eager_ms:
            log.warning("compiled forwards off for model type %r: a one-token step takes %.2f ms compiled, "
                        "%.2f ms eager (auto keeps it below %.0f%%)", kind, compiled_ms, eager_ms, PAYS * 100)
            return None
    log.info("compiled forwards on for model type %r (%.1f s to compile widths %s and check)", kind,
             time.perf_counter() - t, ",".join(map(str, STARTUP_WIDTHS)))
    return compiled
