"""The EAGLE-3 draft head, with the reference checkpoint's tensor names and shapes.

Reference: Li et al., EAGLE-3 (arXiv:2503.01840); layout of the EAGLE authors'
``cnets.py`` ``Model`` (H: the head's width, Ht: the target's, V: the target
vocabulary, Vd: the draft vocabulary, A/K: query/key-value heads of width d):

  fc.weight [H, 3 Ht]            no bias: 3 target features -> one H-wide feature
  midlayer.input_layernorm.weight [H]        normalises the token embedding
  midlayer.hidden_norm.weight [H]            normalises the feature
  midlayer.self_attn.{q,k,v}_proj.weight [A d | K d, 2H]   attends over cat(emb, feature)
  midlayer.self_attn.o_proj.weight [H, A d]
  midlayer.post_attention_layernorm.weight [H]
  midlayer.mlp.{gate,up}_proj.weight [I, H], midlayer.mlp.down_proj.weight [H, I]
  norm.weight [H]                the head's own final norm
  lm_head.weight [Vd, H]         logits over the draft vocabulary
  d2t [Vd] int64                 draft id d is target id d + d2t[d]
  t2d [V] bool                   target ids inside the draft vocabulary
The token embedding [V, H] is the target's, as in the reference; a checkpoint
may carry its own ``embed_tokens.weight`` (needed when H differs from the
target's width), which is then used. It is a non-persistent buffer here, so
``state_dict()`` holds exactly the tensors above.

Target features (layer-index convention): the three inputs are HF
``output_hidden_states`` indices, i.e. index i is the un-normed residual
stream *entering* layer i (0 = the embeddings). The reference reads indices
(2, L // 2, L - 3) of an L-layer target; configs may name others
(``drafter.eagle.eagle3_layouts.feature_layers`` reads each format's counting).

One step at position t: the head gets x_{t+1}'s embedding and a feature g_t
(g_t = fc(cat of the target's three features at t) at the first step, the
head's own previous output afterwards) and returns the pre-norm hidden state
that is both the next step's feature and, through ``draft_logits``, the
distribution of x_{t+2}.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from specdec.model import attention, kv, masks
from specdec.request.errors import InvalidArgument
from drafter.eagle import eagle3_layouts as layouts
from drafter.eagle.eagle2_head import head_config_for, read_weights

EMBED_KEY = "embed_tokens.weight"       # optional on disk (module doc)


def head3_config(fields: dict) -> LlamaConfig:
    """A LlamaConfig for the head from the fields ``eagle3_layouts.llama_fields`` returns."""
    cfg = LlamaConfig(**{k: v for k, v in fields.items() if k not in ("architectures", "eagle_config")})
    cfg.num_hidden_layers = 1
    cfg._attn_implementation = attention.IMPLEMENTATION
    return cfg


def head3_config_for(target_config, draft_vocab_size: int | None = None, hidden_size: int | None = None,
                     layers: tuple[int, ...] | None = None) -> dict:
    """A reference-layout config dict for an EAGLE-3 head over a target of any family.
    ``hidden_size``: the head's width (default the target's; narrower heads get
    ``target_hidden_size``); ``layers``: HF hidden-state indices (default the reference's)."""
    text = target_config.get_text_config(decoder=True)
    config = head_config_for(target_config)
    target_hidden = config["hidden_size"]
    if hidden_size is not None and hidden_size != target_hidden:
        heads = max(1, hidden_size // config["head_dim"])
        config.update(hidden_size=hidden_size, num_attention_heads=heads, num_key_value_heads=heads,
                      intermediate_size=4 * hidden_size)
    layers = tuple(layers or layouts.default_feature_layers(int(text.num_hidden_layers)))
    config.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
                  draft_vocab_size=int(draft_vocab_size or config["vocab_size"]), target_hidden_size=target_hidden,
                  hidden_act="silu", eagle_config={"eagle_aux_hidden_state_layer_ids":
                                                   layouts.reference_layer_ids(layers)})
    return config


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over cat(input_layernorm(embedding), hidden_norm(feature))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        self.self_attn = LlamaAttention(config, layer_idx=0)
        attn = self.self_attn
        attn.q_proj = nn.Linear(2 * hidden, attn.q_proj.out_features, bias=bias)
        attn.k_proj = nn.Linear(2 * hidden, attn.k_proj.out_features, bias=bias)
        attn.v_proj = nn.Linear(2 * hidden, attn.v_proj.out_features, bias=bias)
        self.mlp = LlamaMLP(config)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, embeds, feature, position_embeddings, mask, cache):
        normed = self.hidden_norm(feature)
        residual = normed if self.norm_before_residual else feature
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)            # [B, n, 2H]
        attn, _ = self.self_attn(x, position_embeddings=position_embeddings, attention_mask=mask,
                                 **kv.with_cache(self.self_attn, cache))
        h = residual + attn
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """The EAGLE-3 head (module doc). ``layers``: the HF hidden-state indices it reads."""

    def __init__(self, config: LlamaConfig, layers: tuple[int, ...] = ()):
        super().__init__()
        self.config = config
        hidden, vocab = config.hidden_size, config.vocab_size
        draft_vocab = int(getattr(config, "draft_vocab_size", None) or vocab)
        target_hidden = int(getattr(config, "target_hidden_size", None) or hidden)
        self.layers = tuple(layers)
        self.register_buffer("embedding", None, persistent=False)     # [V, H], see set_embedding
        self.fc = nn.Linear(3 * target_hidden, hidden, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(config)

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.out_features

    def set_embedding(self, table: torch.Tensor) -> None:
        """The token embedding table [V, H] (the target's, or the checkpoint's own)."""
        want = (self.t2d.numel(), self.config.hidden_size)
        if tuple(table.shape) != want:
            raise InvalidArgument(f"an embedding table of shape {tuple(table.shape)} does not fit the head's {want}")
        self.embedding = table.detach().to(self.fc.weight.dtype)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [...] (target ids) -> their embedding rows [..., H]."""
        if self.embedding is None:
            raise RuntimeError("the EAGLE-3 head has no embedding table: call set_embedding first")
        return torch.nn.functional.embedding(tokens, self.embedding)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """features: [..., 3 Ht] (the target's three layers, concatenated low to high) -> [..., H]."""
        return self.fc(features.to(self.fc.weight.dtype))

    def forward(self, token_embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """token_embeds, hidden: [B, n, H] (hidden: ``project``'s output or a previous
        step's); positions: [B, n]; mask: additive [B, 1, n, past + n] or None
        (causal). Returns the pre-norm hidden state [B, n, H]."""
        hidden = hidden.to(token_embeds.dtype)
        past = kv.seq_len(cache) if cache is not None else 0
        if mask is None and past > 0 and hidden.shape[1] > 1:
            # SDPA's implicit causal mask is top-left aligned: wrong over a cache.
            mask = masks.causal_mask(hidden.shape[1], past, hidden.dtype).to(hidden.device)
        pe = self.rotary(hidden, positions)
        return self.midlayer(token_embeds, hidden, pe, mask, cache)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> fp32 logits [..., Vd] over the draft vocabulary."""
        return self.lm_head(self.norm(hidden)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target-vocabulary ids (d + d2t[d])."""
        return draft_ids + self.d2t[draft_ids]

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Fill d2t / t2d from the target ids [Vd] the draft vocabulary keeps (ascending)."""
        target_ids = torch.as_tensor(target_ids, dtype=torch.long)
        if target_ids.shape != self.d2t.shape:
            raise ValueError(f"a draft vocabulary of {self.d2t.numel()} ids, got {tuple(target_ids.shape)}")
        self.d2t.copy_(target_ids - torch.arange(target_ids.numel()))
        self.t2d.zero_()
        self.t2d[target_ids] = True

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.state_dict().items()}


def load_head3(directory: str | Path, dtype=torch.float32, target_layers: int | None = None,
               target_embed: torch.Tensor | None = None) -> Eagle3Head:
    """Load an EAGLE-3 head in the reference or the speculators layout.
    ``target_layers``: the target's depth, for configs that name no layers;
    ``target_embed`` [V, H]: the embedding table, unless the checkpoint carries its own."""
    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise InvalidArgument(f"EAGLE-3 head directory {directory} has no config.json")
    config = json.loads(cfg_path.read_text())
    head = Eagle3Head(head3_config(layouts.llama_fields(config)), layouts.feature_layers(config, target_layers))
    state = fill_vocab_maps(layouts.canonical_keys(read_weights(directory)), head)
    embed = state.pop(EMBED_KEY, None)
    expected = head.expected_shapes() | {EMBED_KEY: (head.t2d.numel(), head.config.hidden_size)}
    layouts.check_state(state | ({} if embed is None else {EMBED_KEY: embed}), expected, (EMBED_KEY,), directory)
    own = head.state_dict()
    head.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})
    head = head.to(dtype).eval()
    if embed is not None or target_embed is not None:
        head.set_embedding(embed if embed is not None else target_embed)
    return head


def fill_vocab_maps(state: dict, head: Eagle3Head) -> dict:
    """``state`` with the vocabulary maps a released head may leave out: ``t2d``
    (only training reads it) rebuilt from ``d2t``; ``d2t`` of a head whose draft
    vocabulary is the whole vocabulary, the identity. A head with a reduced
    vocabulary and no ``d2t`` stays without it (its error names it)."""
    state = dict(state)
    vocab, draft = head.t2d.numel(), head.draft_vocab_size
    if "d2t" not in state and draft == vocab:
        state["d2t"] = torch.zeros(draft, dtype=torch.long)
    d2t = state.get("d2t")
    if "t2d" not in state and d2t is not None and tuple(d2t.shape) == (draft,):
        ids = torch.arange(draft) + d2t.long()
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids[(ids >= 0) & (ids < vocab)]] = True     # ids out of range: the drafter refuses the d2t
        state["t2d"] = t2d
    return state


def save_head(head: Eagle3Head, directory: str | Path, dtype=torch.float16, with_embedding: bool = False) -> None:
    """Write config.json + model.safetensors in the reference layout (float
    tensors in ``dtype``; d2t/t2d keep their integer/bool types); ``with_embedding``
    also writes the head's embedding table as ``embed_tokens.weight``."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = head.config.to_dict()
    for name in ("_attn_implementation", "eagle_config", "norm_before_residual"):
        config.pop(name, None)
    config.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
                  draft_vocab_size=head.draft_vocab_size, target_hidden_size=head.fc.in_features // 3)
    if head.midlayer.norm_before_residual:
        config["norm_before_residual"] = True
    if head.layers:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layouts.reference_layer_ids(head.layers)}
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    state = dict(head.state_dict())
    if with_embedding:
        state[EMBED_KEY] = head.embedding
    state = {k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous() for k, v in state.items()}
    save_file(state, directory / "model.safetensors")
