"""Export a Hugging Face Llama-architecture causal LM to a GGUF file (f32), so
llama.cpp runs exactly the weights specdec serves (``specdec bench``'s
llama.cpp peer).

What llama.cpp's ``llama`` architecture expects, and where it differs from
the HF checkpoint:

- tensor names: ``token_embd``, ``blk.{i}.attn_norm`` / ``attn_q`` / ``attn_k``
  / ``attn_v`` / ``attn_output`` / ``ffn_norm`` / ``ffn_gate`` / ``ffn_up`` /
  ``ffn_down``, ``output_norm``, ``output`` (taken from the ``gguf`` package's
  own name table, ``gguf.TENSOR_NAMES``);
- rotary layout: HF Llama rotates the two *halves* of each head
  (``rotate_half``), llama.cpp's ``llama`` rope rotates *adjacent pairs*; the
  rows of q_proj (and k_proj, with the KV head count) are reordered per head
  from [half0 | half1] to interleaved pairs, which leaves q·k unchanged;
- metadata: ``llama.*`` hyper-parameters (context, width, depth, FFN width,
  heads, KV heads, head dims, RMS eps, rope base) and ``general.file_type`` 0
  (all f32);
- the tokenizer: a byte-level BPE ``tokenizer.json`` becomes llama.cpp's
  ``gpt2`` tokenizer (tokens, token types, merges, BOS/EOS), so text prompts
  tokenize as the HF tokenizer does. The bench feeds token ids directly anyway.

Only plain Llama stacks are exported (no attention/MLP bias, default rope);
anything else is refused with ``UnsupportedExport`` naming the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

try:                                   # the optional `llamacpp` extra
    import gguf
except ImportError:                    # pragma: no cover - depends on the environment
    gguf = None

ARCH = "llama"
FILE_TYPE_ALL_F32 = 0          # llama_ftype LLAMA_FTYPE_ALL_F32
# llama_ftype of files whose matrices are one block quantization (LLAMA_FTYPE_MOSTLY_*)
FILE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9}
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_UNUSED = 1, 3, 5   # gguf.TokenType values


class UnsupportedExport(ValueError):
    """A model this exporter cannot write as a llama.cpp ``llama`` GGUF."""


@dataclass(frozen=True)
class LlamaShape:
    """The hyper-parameters llama.cpp reads from ``llama.*`` keys."""

    vocab: int
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    rms_eps: float
    rope_base: float

    @classmethod
    def of(cls, config) -> LlamaShape:
        if getattr(config, "model_type", None) != "llama":
            raise UnsupportedExport(f"only Llama models export to GGUF here, not {config.model_type!r}")
        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            raise UnsupportedExport("attention or MLP biases are not in llama.cpp's llama architecture")
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise UnsupportedExport(f"rope type {rope.get('rope_type')!r} is not exported (default rope only)")
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        return cls(vocab=int(config.vocab_size), hidden=int(config.hidden_size),
                   layers=int(config.num_hidden_layers), ffn=int(config.intermediate_size), heads=heads,
                   kv_heads=int(getattr(config, "num_key_value_heads", None) or heads), head_dim=head_dim,
                   context=int(config.max_position_embeddings), rms_eps=float(config.rms_norm_eps),
                   rope_base=float(rope.get("rope_theta", 10000.0)))


def interleave_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a q/k projection [heads * head_dim, in] reordered per head from
    HF's half-split rotary layout to llama.cpp's adjacent pairs: row j of the
    first half and row j of the second half become rows 2j and 2j + 1."""
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def llama_tensors(state: dict[str, torch.Tensor], shape: LlamaShape) -> dict[str, np.ndarray]:
    """GGUF name -> f32 array, from a ``LlamaForCausalLM`` state dict."""
    names, T = gguf.TENSOR_NAMES, gguf.MODEL_TENSOR

    def f32(key: str) -> np.ndarray:
        if key not in state:
            raise UnsupportedExport(f"the checkpoint has no tensor {key!r}")
        return state[key].detach().to(torch.float32).cpu().numpy()

    out = {names[T.TOKEN_EMBD] + ".weight": f32("model.embed_tokens.weight"),
           names[T.OUTPUT_NORM] + ".weight": f32("model.norm.weight"),
           names[T.OUTPUT] + ".weight": f32("lm_head.weight" if "lm_head.weight" in state
                                            else "model.embed_tokens.weight")}
    per_layer = ((T.ATTN_NORM, "input_layernorm"), (T.ATTN_Q, "self_attn.q_proj"), (T.ATTN_K, "self_attn.k_proj"),
                 (T.ATTN_V, "self_attn.v_proj"), (T.ATTN_OUT, "self_attn.o_proj"),
                 (T.FFN_NORM, "post_attention_layernorm"), (T.FFN_GATE, "mlp.gate_proj"),
                 (T.FFN_UP, "mlp.up_proj"), (T.FFN_DOWN, "mlp.down_proj"))
    for i in range(shape.layers):
        for kind, hf in per_layer:
            w = f32(f"model.layers.{i}.{hf}.weight")
            if kind == T.ATTN_Q:
                w = interleave_rotary(w, shape.heads)
            elif kind == T.ATTN_K:
                w = interleave_rotary(w, shape.kv_heads)
            out[names[kind].format(bid=i) + ".weight"] = np.ascontiguousarray(w)
    return out


@dataclass(frozen=True)
class GgufVocab:
    """A byte-level BPE vocabulary as llama.cpp's ``gpt2`` tokenizer reads it."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    bos: int | None
    eos: int | None


def read_vocab(model_dir: str | Path, vocab_size: int) -> GgufVocab:
    """The vocabulary of ``model_dir/tokenizer.json`` (byte-level BPE), padded to ``vocab_size``."""
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise UnsupportedExport(f"{model_dir} has no tokenizer.json")
    spec = json.loads(path.read_text())
    model = spec.get("model", {})
    if model.get("type") != "BPE" or (spec.get("pre_tokenizer") or {}).get("type") != "ByteLevel":
        raise UnsupportedExport("only byte-level BPE tokenizers are exported (llama.cpp's gpt2 tokenizer)")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [TOKEN_UNUSED] * vocab_size
    for text, idx in model["vocab"].items():
        if idx < vocab_size:
            tokens[idx], types[idx] = text, TOKEN_NORMAL
    for added in spec.get("added_tokens", []):
        if added["id"] < vocab_size:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = TOKEN_CONTROL if added.get("special") else TOKEN_NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    ids = {text: i for i, text in enumerate(tokens)}
    return GgufVocab(tokens, types, merges, ids.get(_token_text(cfg.get("bos_token"))),
                     ids.get(_token_text(cfg.get("eos_token"))))


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _stored(name: str, array: np.ndarray, quant: str | None) -> tuple[np.ndarray, object]:
    """``array`` as written: f32, or quantized to ``quant`` (a ``gguf.GGMLQuantizationType``
    name) when it is a matrix whose rows fill whole blocks (norms and odd widths stay f32)."""
    array = array.astype(np.float32, copy=False)
    if quant is None or array.ndim != 2:
        return array, None
    qtype = gguf.GGMLQuantizationType[quant]
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if array.shape[-1] % block:
        return array, None
    return gguf.quants.quantize(array, qtype), qtype


def write_gguf(path: str | Path, shape: LlamaShape, tensors: dict[str, np.ndarray],
               vocab: GgufVocab | None, name: str = "specdec", quant: str | None = None) -> Path:
    """Write one GGUF file: ``llama.*`` metadata, the tokenizer, the tensors (f32,
    or the matrices quantized to ``quant``, e.g. ``"Q8_0"`` or ``"Q4_1"``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name(name)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_base)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_vocab_size(shape.vocab)
    w.add_file_type(FILE_TYPE_ALL_F32 if quant is None else FILE_TYPES[quant])
    if vocab is not None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(vocab.tokens)
        w.add_token_types(vocab.types)
        w.add_token_merges(vocab.merges)
        if vocab.bos is not None:
            w.add_bos_token_id(vocab.bos)
        if vocab.eos is not None:
            w.add_eos_token_id(vocab.eos)
        w.add_add_bos_token(False)       # the HF tokenizer adds no BOS (no template special tokens)
    for tensor_name, array in tensors.items():
        data, qtype = _stored(tensor_name, array, quant)
        w.add_tensor(tensor_name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def export_llama(model_dir: str | Path, out_path: str | Path, model=None, quant: str | None = None) -> Path:
    """Convert the HF Llama in ``model_dir`` (or the loaded ``model`` of it) to
    ``out_path`` (GGUF with its tokenizer; f32, or matrices in ``quant``, one of
    ``FILE_TYPES``). Raises ``UnsupportedExport``."""
    if gguf is None:
        raise UnsupportedExport("the gguf package is not installed (pip install 'specdec[llamacpp]')")
    config = model.config if model is not None else AutoConfig.from_pretrained(model_dir)
    shape = LlamaShape.of(config)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tensors = llama_tensors(model.state_dict(), shape)
    if quant is not None and quant not in FILE_TYPES:
        raise UnsupportedExport(f"quantization {quant!r} is not exported (one of {', '.join(FILE_TYPES)})")
    return write_gguf(out_path, shape, tensors, read_vocab(model_dir, shape.vocab), name=Path(model_dir).name,
                      quant=quant)
