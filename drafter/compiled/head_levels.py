"""Compiled draft levels of an EAGLE head (``--compile`` on the drafter).

A draft level runs the head on a frontier of a few tree nodes: one decoder
layer and the vocabulary projection, ~0.5 ms eager on the demo head, nearly
all of it per-operator dispatch, six or more times a cycle. As the target's
compiled forwards do (``specdec.compile.forwards``), the level runs as one fixed-shape
graph per frontier width over a session cache that is one stacked buffer
[1, 2, 1, heads, C, d] at ``HEAD_CAPACITY`` slots:

- ``HeadStep``: the head's token embedding, its layer over the stacked cache
  (new K/V written at slots given as a tensor), and its log-probs over the
  target vocabulary, as ``FeatureHeadDrafter.step`` computes them eagerly;
- widths padded to the next of ``WIDTHS`` (all built at start-up; with
  ``SPECDEC_COMPILE_AHEAD=ready`` only ``READY_WIDTHS``, the rest on first use), the tree
  mask padded to the capacity (pad queries see only their own slot; their
  outputs are dropped);
- on CPU the graphs are AOTInductor packages (``specdec.compile.aot``),
  built once and loaded on later starts, with the head's weights packed into
  them (``SPECDEC_COMPILE_PACKED_HEADS=off``: over the head's own weights, ~3x
  faster to build, slower levels; a head whose packed copies would not fit ``PACKED_BUDGET``, the
  vocabulary tables of a large target, drafts eagerly); on a GPU they are
  ``torch.compile`` graphs over the head's own weights, replayed as CUDA
  graphs (``specdec.compile.cuda_graphs``), as the target's are.

Feeding a cycle's committed pairs (a few tokens, causal) takes the same
graphs; a prompt's (wider) stays eager and writes into the same buffer. A
session whose cache outgrows the capacity (the slab reallocates) or a level
wider than the widest graph runs eagerly: ``CompiledHead.step`` returns None. A head that fails to
compile, or whose compiled log-probs differ from its eager ones on a check at
load, drafts eagerly with one log line saying why (``compile_head``).
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from specdec.compile.fixed_graphs import ahead_setting, packed_heads_setting
from specdec.compile.fixed_kv import FixedLayer, cache_shape, fixed_buffers, stacked_cache
from specdec.compile.forwards import PACKED_BUDGET, PAYS, FixedGraphs
from specdec.model import kv
from specdec.model.loading import COMPILE_MODES
from specdec.request.knobs import DEFAULT_EXPAND_K

log = logging.getLogger(__name__)

HEAD_CAPACITY = 512               # a session's committed tokens plus its tree's nodes, for most sessions
WIDTHS = (1, 2, 4, 8, 16)              # frontier widths compiled, at start-up (expand_k <= 16; wider: eager)
# built before readiness with SPECDEC_COMPILE_AHEAD=ready: the root's and a default tree's levels
READY_WIDTHS = (1, next(w for w in WIDTHS if w >= DEFAULT_EXPAND_K))


class HeadStep(torch.nn.Module):
    """One draft level of a feature head as a fixed-shape forward."""

    def __init__(self, drafter):
        super().__init__()
        self.head = drafter.head                 # registered: the export sees its weights by name
        self.drafter = drafter
        # and the tensors it reads besides them, as buffers the traced step reads (``reading``): a
        # package over shared weights binds them by name
        tensors = drafter.step_tensors()
        self.names = tuple(tensors)
        for name, t in tensors.items():
            self.register_buffer(name, t, persistent=False)

    def forward(self, tokens, parent, positions, mask, slots, stack):
        """tokens, positions [1, nb]; parent [1, nb, H] (the parents' outputs);
        mask [1, 1, nb, C]; slots [nb]; stack [1, 2, 1, heads, C, d], the nb new
        slots written in place. Returns (outputs [1, nb, H], log-probs [1, nb, V])."""
        cache = Cache(layers=[FixedLayer(stack, 0, slots)])
        drafter = self.drafter.reading({name: getattr(self, name) for name in self.names})
        out = drafter.head(drafter.embed_tokens(tokens), parent, positions, mask, cache)
        return out, drafter.logprobs(out)


class HeadKey(torch.nn.Module):
    """What a head's packages are keyed by: its weights and the tensors its step reads besides them."""

    def __init__(self, drafter):
        super().__init__()
        self.head = drafter.head
        for name, t in drafter.step_tensors().items():
            self.register_buffer(name, t, persistent=True)


@dataclass(frozen=True)
class FeedBuffers:
    """A feed's inputs at one width, kept on the device and written there (``CompiledHead.feed``)."""

    tokens: torch.Tensor      # [1, width] int64, filled per feed (pad entries: whatever was there)
    parent: torch.Tensor      # [1, width, H] the pairs' features, copied in per feed
    rows: torch.Tensor        # [width] 0..width-1
    offsets: torch.Tensor     # [width, C] slot - row: row i sees slot s when s - i <= the cached slots
    zero: torch.Tensor        # [] 0 and the dtype's minimum, the mask's two values
    minimum: torch.Tensor

    @classmethod
    def new(cls, width: int, capacity: int, hidden: int, dtype: torch.dtype, device: torch.device) -> FeedBuffers:
        rows = torch.arange(width, device=device)
        return cls(torch.zeros(1, width, dtype=torch.long, device=device),
                   torch.zeros(1, width, hidden, dtype=dtype, device=device), rows,
                   torch.arange(capacity, device=device)[None] - rows[:, None],
                   torch.zeros((), dtype=dtype, device=device),
                   torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device))


class CompiledHead:
    """Compiled draft levels of one feature-head drafter (module doc)."""

    def __init__(self, drafter, packed: bool = True):
        self.drafter = drafter
        head = drafter.head
        self.dtype = head.fc.weight.dtype
        self.device = head.fc.weight.device
        self.layers, self.heads, self.head_dim = self._probe()
        sources = tuple({inspect.getfile(type(m)) for m in head.modules()} | {inspect.getfile(type(drafter))})
        # packages on CPU; on a GPU torch.compile graphs replayed as CUDA graphs (``specdec.compile.forwards``)
        self.steps = FixedGraphs(HeadStep(drafter).eval(), HeadKey(drafter), self.dtype, self.device,
                                    ahead_of_time=self.device.type == "cpu", packed=packed, sources=sources,
                                    packaged_capacities=(HEAD_CAPACITY,))
        self.feeds: dict[int, FeedBuffers] = {}     # width -> a feed's device buffers (``feed``)

    @torch.inference_mode()
    def _probe(self) -> tuple[int, int, int]:
        cache = kv.new_cache(self.drafter.head.config)
        h = self.drafter.hidden_size
        self.drafter.head(torch.zeros(1, 1, h, dtype=self.dtype, device=self.device),
                          torch.zeros(1, 1, h, dtype=self.dtype, device=self.device),
                          torch.zeros(1, 1, dtype=torch.long, device=self.device), None, cache)
        return cache_shape(cache)

    def new_stack(self, capacity: int = HEAD_CAPACITY) -> torch.Tensor:
        return torch.zeros((self.layers, 2, 1, self.heads, capacity, self.head_dim), dtype=self.dtype,
                           device=self.device)

    def new_cache(self):
        """A session cache whose one layer is a view into a stacked buffer of ``HEAD_CAPACITY`` slots."""
        with torch.inference_mode():
            return stacked_cache(kv.new_cache(self.drafter.head.config), self.new_stack())

    def graph(self, width: int, mask: torch.Tensor):
        def example():
            pos = torch.arange(width, device=self.device)[None]
            parent = torch.zeros(1, width, self.drafter.hidden_size, dtype=self.dtype, device=self.device)
            return torch.zeros_like(pos), parent, pos, mask, pos[0], self.new_stack()
        return self.steps.get(width, HEAD_CAPACITY, example)

    @torch.inference_mode()
    def step(self, cache, tokens: torch.Tensor, parent_hidden: torch.Tensor, positions: torch.Tensor,
             allowed: torch.Tensor, resident: bool = False):
        """As ``FeatureHeadDrafter.step`` for tokens, positions [k], parent_hidden
        [k, H], allowed [k, past + k]: (outputs [k, H], log-probs [k, V]); None
        where the compiled path does not apply (the caller runs eagerly).
        ``resident``: every input is on the device already (a tree drafted
        there, ``specdec.tree.drawn``): nothing is copied up."""
        k = tokens.shape[0]
        fixed, width = fixed_buffers(cache), next((w for w in WIDTHS if w >= k), None)
        past = kv.seq_len(cache)
        if fixed is None or width is None or past + width > fixed.stack.shape[4]:
            return None
        dev = self.device
        if resident:
            pad = width - k
            mask = self.padded_mask(allowed, width, fixed.stack.shape[4])
            tokens = torch.cat([tokens, tokens.new_zeros(pad)])[None]
            positions = torch.cat([positions, positions[-1:].expand(pad)])[None]
            parent = torch.cat([parent_hidden.to(self.dtype), parent_hidden.new_zeros(pad, parent_hidden.shape[1],
                                                                                     dtype=self.dtype)])[None]
            return self._run(cache, fixed, width, k, past, tokens, parent, positions, mask)
        mask = self.padded_mask(allowed, width, fixed.stack.shape[4]).to(dev)
        pad = width - k
        if tokens.device == positions.device and tokens.dtype == positions.dtype:
            # padded where they are (the host, from the tree builder), then one copy to the device
            tokens, positions = torch.stack([torch.cat([tokens, tokens.new_zeros(pad)]),
                                             torch.cat([positions, positions[-1:].expand(pad)])]).to(dev)[:, None]
        else:
            tokens = torch.cat([tokens.to(dev), tokens.new_zeros(pad, device=dev)])[None]
            positions = torch.cat([positions.to(dev), positions[-1:].to(dev).expand(pad)])[None]
        parent = torch.cat([parent_hidden.to(dev, self.dtype),
                            parent_hidden.new_zeros(pad, parent_hidden.shape[1], device=dev, dtype=self.dtype)])[None]
        return self._run(cache, fixed, width, k, past, tokens, parent, positions, mask)

    def _run(self, cache, fixed, width: int, k: int, past: int, tokens, parent, positions, mask):
        """``step``'s level on its padded device inputs."""
        slots = torch.arange(past, past + width, device=self.device)
        out, logp = self.graph(width, mask)(tokens, parent, positions, mask, slots, fixed.stack)
        k_view, v_view = fixed.views[0]
        kv.adopt(cache, 0, k_view, v_view, past + k)
        return out[0, :k], logp[0, :k]

    @torch.inference_mode()
    def feed(self, cache, tokens: list[int], feats: torch.Tensor, ids: torch.Tensor | None = None):
        """``step`` for committed pairs (tokens [k] Python ints, feats [k, H] on the
        device), each seeing the cached slots and the pairs before it, with no host
        tensor: the tokens are filled into a device buffer (copied in one operator
        where ``ids`` has them on the device already), the causal mask and the
        positions (the slots) made on the device. None where ``step`` would be."""
        k = len(tokens)
        fixed, width = fixed_buffers(cache), next((w for w in WIDTHS if w >= k), None)
        past = kv.seq_len(cache)
        if fixed is None or width is None or past + width > fixed.stack.shape[4] or k == 0:
            return None
        buf = self.feeds.get(width)
        if buf is None or buf.offsets.shape[1] != fixed.stack.shape[4]:
            buf = self.feeds[width] = FeedBuffers.new(width, fixed.stack.shape[4], self.drafter.hidden_size,
                                                      self.dtype, self.device)
        if ids is not None and ids.device == buf.tokens.device:
            buf.tokens[0, :k].copy_(ids)
        else:
            for i, token in enumerate(tokens):
                buf.tokens[0, i].fill_(token)
        buf.parent[0, :k].copy_(feats)
        slots = buf.rows + past                                                   # [width], the positions too
        # row i sees slots <= past + i; a pad row sees the same causal prefix (its output is dropped, and
        # its K/V lands past the cache's length, where nothing reads it before it is written again)
        mask = torch.where(buf.offsets <= past, buf.zero, buf.minimum)[None, None]    # [1, 1, width, C]
        out, logp = self.graph(width, mask)(buf.tokens, buf.parent, slots[None], mask, slots, fixed.stack)
        k_view, v_view = fixed.views[0]
        kv.adopt(cache, 0, k_view, v_view, past + k)
        return out[0, :k], logp[0, :k]

    def padded_mask(self, allowed: torch.Tensor, width: int, capacity: int) -> torch.Tensor:
        """``specdec.compile.fixed_kv.pad_mask`` of the additive mask of ``allowed`` [k, past + k],
        built in one buffer: [1, 1, width, capacity]."""
        k, seen = allowed.shape
        mask = torch.full((width, capacity), torch.finfo(self.dtype).min, dtype=self.dtype, device=allowed.device)
        mask[:k, :seen].masked_fill_(allowed, 0.0)
        if width > k:
            pads = torch.arange(k, width, device=allowed.device)
            mask[pads, seen - k + pads] = 0.0          # a pad query sees only its own slot
        return mask[None, None]

    def warm(self, widths=WIDTHS) -> float:
        """Build (or load) and run the graphs for ``widths`` ahead of traffic; seconds taken."""
        t = time.perf_counter()
        for width in widths:
            cache = self.new_cache()
            self.step(cache, torch.zeros(width, dtype=torch.long), torch.zeros(width, self.drafter.hidden_size),
                      torch.arange(width), torch.ones(width, width, dtype=torch.bool).tril())
        return time.perf_counter() - t


@torch.inference_mode()
def check_head(compiled: CompiledHead) -> str | None:
    """Why the compiled levels cannot serve this head (None: they can): after
    eagerly fed pairs, a 3-node level must give the eager outputs and log-probs
    and leave the cache as long."""
    drafter = compiled.drafter
    gen = torch.Generator().manual_seed(0)
    h = drafter.hidden_size
    fed = torch.randint(0, drafter.vocab_size, (5,), generator=gen)
    feats = torch.randn(1, 5, h, generator=gen).to(compiled.dtype)
    tokens = torch.randint(0, drafter.vocab_size, (3,), generator=gen)
    parent = torch.randn(3, h, generator=gen).to(compiled.dtype)
    positions = torch.tensor([5, 6, 6])
    allowed = torch.cat([torch.ones(3, 5, dtype=torch.bool),
                         torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)], dim=1)
    results = {}
    for run in ("compiled", "eager"):
        cache = compiled.new_cache()
        drafter.head(drafter.embed_tokens(fed.to(compiled.device))[None], feats.to(compiled.device),
                     torch.arange(5, device=compiled.device)[None], None, cache)
        if run == "compiled":
            got = compiled.step(cache, tokens, parent, positions, allowed)
            if got is None:
                return "a 3-node level does not take the compiled path"
        else:
            got = drafter.eager_step(cache, tokens, parent, positions, allowed)
        if kv.seq_len(cache) != 8:
            return f"the {run} path left {kv.seq_len(cache)} cached slots, not 8"
        results[run] = got
    for got, want in zip(results["compiled"], results["eager"]):
        finite = torch.isfinite(want)
        if not torch.equal(finite, torch.isfinite(got)):
            return "compiled log-probs are finite where eager ones are not"
        err = float((got[finite] - want[finite]).abs().max() / (1.0 + want[finite].abs().max()))
        if not err <= (1e-4 if compiled.dtype == torch.float32 else 5e-2):
            return f"compiled outputs differ from eager ones (relative error {err:.2g})"
    return None


@torch.inference_mode()
def time_level(drafter, step, cache, width: int = 4, prefix: int = 64, repeats: int = 20) -> float:
    """Median ms of ``step`` on a ``width``-node level after ``prefix`` fed pairs."""
    h = drafter.hidden_size
    dev = drafter.device
    drafter.head(drafter.embed_tokens(torch.zeros(1, prefix, dtype=torch.long, device=dev)),
                 torch.zeros(1, prefix, h, device=dev), torch.arange(prefix, device=dev)[None], None, cache)
    args = (torch.zeros(width, dtype=torch.long), torch.zeros(width, h), torch.full((width,), prefix),
            torch.ones(width, prefix + width, dtype=torch.bool))
    times = []
    for _ in range(repeats + 2):
        t = time.perf_counter()
        step(cache, *args)
        times.append(time.perf_counter() - t)
        kv.truncate(cache, prefix)
    return sorted(times[2:])[repeats // 2] * 1000


def compile_head(drafter, mode: str) -> CompiledHead | None:
    """The compiled draft levels of ``drafter`` for ``--compile MODE``, or None
    (eager): off; a head too large to pack; compilation or the check failed (one
    log line says why); or, with auto, a compiled level is not faster than an eager one."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"--compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    if mode == "off":
        return None
    name = getattr(drafter, "name", "head")
    weight_bytes = sum(t.numel() * t.element_size() for t in HeadKey(drafter).state_dict().values())
    t = time.perf_counter()
    reason = None
    on_cpu = torch.device(drafter.device).type == "cpu"     # packed copies: on CPU only (CompiledHead)
    packed = packed_heads_setting() != "off"
    if on_cpu and packed and weight_bytes * len(WIDTHS) > PACKED_BUDGET:
        reason = (f"its weights ({weight_bytes >> 20} MiB with the vocabulary tables) are too large to pack once "
                  f"per width")
    else:
        try:
            compiled = CompiledHead(drafter, packed=packed)
            reason = check_head(compiled)
            if reason is None:
                compiled.warm(WIDTHS if ahead_setting() == "all" else READY_WIDTHS)
        except Exception as exc:  # noqa: BLE001 - any failure means: draft eagerly
            reason = f"compilation failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    if reason is not None:
        log.warning("compiled draft levels off for the %s drafter: %s; drafting eagerly", name, reason)
        return None
    if mode == "auto":
        eager_ms = time_level(drafter, drafter.eager_step, compiled.new_cache())
        compiled_ms = time_level(drafter, compiled.step, compiled.new_cache())
        if compiled_ms > PAYS * eager_ms:
            log.warning("compiled draft levels off for the %s drafter: a 4-node level takes %.2f ms compiled, "
                        "%.2f ms eager (auto keeps it below %.0f%%)", name, compiled_ms, eager_ms, PAYS * 100)
            return None
    log.info("compiled draft levels on for the %s drafter (%.1f s to build or load widths %s and check)", name,
             time.perf_counter() - t, ",".join(map(str, WIDTHS)))
    return compiled
