"""A Hugging Face causal LM as specdec runs it: body, masks, cache and logits,
for every attention layout transformers ships.

The target (verifier) and a draft LM both run a model's decoder stack over a
specdec KV cache (``specdec.model.kv``) with explicit positions and a 4-D mask that
encodes the tree, and turn its final hidden states into logits themselves. So
what a model's own forward would add has to be done here:

- the mask: sliding-window layers get the window (``specdec.model.masks``), hybrid
  stacks a mask per layer type;
- ALiBi (Falcon-RW, BLOOM, MPT): biases by token position, not cache slot,
  through the model's own blocks (``specdec.model.alibi``);
- the logits: ``lm_head(hidden)`` followed by the model's own final-logit
  processing (Gemma's final soft-cap, Cohere's ``logit_scale``, Granite's
  ``logits_scaling``), so sampled output follows the model's distribution.

``check_servable`` proves both on the loaded model before it serves a token: a
tree forward over a cached prefix must give the logits of the model's own
plain forwards. A model that fails is refused with one line naming its type
and the reason (``UnsupportedModel``), never a shape error mid-generation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdec.model import kv
from specdec.model.alibi import AlibiMask, alibi_stack
from specdec.model.masks import FULL, SLIDING, AttentionLayout, causal_allowed
from specdec.model.quantize import compute_dtype


class UnsupportedModel(ValueError):
    """A model specdec cannot serve correctly (raised at load)."""


def refuse(config, reason: str) -> UnsupportedModel:
    return UnsupportedModel(f"model type {getattr(config, 'model_type', '?')!r} cannot be served: {reason}")


def attention_layout(config) -> AttentionLayout:
    """Per-layer attention kinds from transformers' own cache layout for ``config``."""
    types = kv.layer_types(config)
    bad = sorted({t for t in types if t not in kv.ATTENTION_LAYER_TYPES})
    if bad:
        raise refuse(config, f"layers of type {', '.join(bad)} keep state that cannot be rolled back slot by slot")
    text = config.get_text_config(decoder=True)
    window = getattr(text, "sliding_window", None) if SLIDING in types else None
    if SLIDING in types and not window:
        raise refuse(config, "sliding-window layers without a sliding_window size")
    return AttentionLayout(tuple(FULL if t == FULL else SLIDING for t in types), window)


def final_logit_transform(config) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model's own processing of ``lm_head(hidden)``, as its ForCausalLM applies it."""
    text = config.get_text_config(decoder=True)
    softcap = getattr(text, "final_logit_softcapping", None)
    scale = getattr(text, "logit_scale", None)             # Cohere: logits * logit_scale
    divide = getattr(text, "logits_scaling", None)         # Granite: logits / logits_scaling

    def transform(logits: torch.Tensor) -> torch.Tensor:
        if scale is not None:
            logits = logits * scale
        if divide is not None:
            logits = logits / divide
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    return transform


class CausalLm:
    """A loaded ``*ForCausalLM`` run over specdec caches with specdec masks."""

    def __init__(self, model, check: bool = True):
        self.model = model
        self.config = model.config
        self.layout = attention_layout(self.config)
        self.body = model.get_decoder()
        self.alibi = alibi_stack(model)             # None unless the model uses ALiBi
        self.lm_head = model.get_output_embeddings()
        self.transform = final_logit_transform(self.config)
        first = next(model.parameters())
        self.dtype, self.device = first.dtype, first.device
        if check:
            check_servable(self)

    def new_cache(self, capacity: int = 0):
        return kv.new_cache(self.config, capacity)

    def masks(self, allowed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, resident: bool = False):
        """The ``attention_mask`` for allowed [B, q, k] bool, query positions [B, q]
        and the positions of the tokens in the key slots [B, k] (``specdec.model.masks``;
        an ALiBi model's: ``specdec.model.alibi.AlibiMask``); ``resident``: the
        inputs are on the device already, the mask is made there."""
        if self.alibi is not None:
            return self.alibi.mask(allowed, k_pos)
        out = self.layout.masks(allowed, q_pos, k_pos, self.dtype)
        if resident:
            return out
        if isinstance(out, dict):
            return {kind: m.to(self.device) for kind, m in out.items()}
        return out.to(self.device)

    def causal_masks(self, past: int, positions: torch.Tensor):
        """Masks for n new tokens [B, n] after ``past`` cached ones whose slot i
        holds position i; None where the model's own causal handling is exact
        (no window: SDPA's causal path stays fast; ALiBi: slots are positions)."""
        if not self.layout.windowed:
            return None
        B, n = positions.shape
        k_pos = torch.cat([torch.arange(past).expand(B, past), positions], dim=1)
        return self.masks(causal_allowed(n, past).expand(B, n, past + n), positions, k_pos)

    def hidden(self, cache, tokens: torch.Tensor, positions: torch.Tensor, mask) -> torch.Tensor:
        """tokens, positions [B, n]; mask from ``masks`` or None (causal after the
        cache). Appends n slots to ``cache``; returns final hidden states [B, n, H]."""
        if mask is None:
            mask = self.causal_masks(kv.seq_len(cache), positions)
        if isinstance(mask, AlibiMask):
            return self.alibi.hidden(cache, tokens.to(self.device), positions.to(self.device), mask)
        out = self.body(input_ids=tokens.to(self.device), position_ids=positions.to(self.device),
                        attention_mask=mask, use_cache=True, **kv.with_cache(self.body, cache))
        return out.last_hidden_state

    def hidden_and_layers(self, cache, tokens: torch.Tensor, positions: torch.Tensor, mask,
                          layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden``, plus the residual stream entering each of ``layers`` (HF
        ``output_hidden_states`` indices below the layer count: 0 is the
        embedding output), concatenated in order: [B, n, len(layers) * H]."""
        if mask is None:
            mask = self.causal_masks(kv.seq_len(cache), positions)
        out = self.body(input_ids=tokens.to(self.device), position_ids=positions.to(self.device),
                        attention_mask=mask, use_cache=True, output_hidden_states=True,
                        **kv.with_cache(self.body, cache))
        return out.last_hidden_state, torch.cat([out.hidden_states[i] for i in layers], dim=-1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final hidden states [..., H], with the model's own processing."""
        return self.transform(self.lm_head(hidden.to(self.dtype))).float()


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-3 if dtype == torch.float32 else 5e-2


@torch.inference_mode()
def check_servable(lm: CausalLm) -> None:
    """A tree forward over a cached prefix gives the logits of the model's own
    plain forwards (siblings included), and ``lm.logits`` is the model's own
    head; else ``UnsupportedModel`` with the reason."""
    vocab = int(lm.config.get_text_config(decoder=True).vocab_size)
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, vocab, (7,), generator=gen)              # prefix 0..3, then 4, 5, 6
    other = (seq[5] + 1) % vocab                                     # a sibling of token 5
    # tree: node 0 = seq[3] (root), 1 = other (child of 0), 2 = seq[4] (child of 0), 3 = seq[5] (child of 2)
    tree = torch.stack([seq[3], other, seq[4], seq[5]])
    ancestor = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    positions = torch.tensor([3, 4, 4, 5])
    try:
        cache = lm.new_cache()
        lm.hidden(cache, seq[None, :3], torch.arange(3)[None], None)
        k_pos = torch.cat([torch.arange(3), positions])[None]
        allowed = torch.cat([torch.ones(4, 3, dtype=torch.bool), ancestor], dim=1)[None]
        got = lm.logits(lm.hidden(cache, tree[None], positions[None], lm.masks(allowed, positions[None], k_pos)))[0]
        main = lm.model(input_ids=seq[None, :6].to(lm.device)).logits[0].float()
        side = lm.model(input_ids=torch.cat([seq[:4], other[None]])[None].to(lm.device)).logits[0, -1].float()
    except UnsupportedModel:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure here is the reason the model is refused
        raise refuse(lm.config, f"a tree forward over a cached prefix fails ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    want = torch.stack([main[3], side, main[4], main[5]])
    err = float((got - want).abs().max() / (1.0 + want.abs().max()))
    tolerance = _tolerance(compute_dtype(lm.model, lm.dtype))
    if not err <= tolerance:
        plain = lm.logits(lm.model.get_decoder()(input_ids=seq[None, :6].to(lm.device)).last_hidden_state)[0]
        if float((plain - main).abs().max() / (1.0 + main.abs().max())) > tolerance:
            raise refuse(lm.config, "its final-logit processing is not one specdec knows")
        raise refuse(lm.config, f"a tree forward over a cached prefix does not reproduce its own forward "
                                f"(relative error {err:.2g})")
