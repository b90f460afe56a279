"""Models as users hold them: a GGUF file served as a Hugging Face directory.

``--target`` and ``--draft-lm`` take a GGUF file (llama.cpp's format) as well
as a directory. The file is read by transformers' GGUF loader (with the
``gguf`` package), its weights dequantized to float32, and written once as an
ordinary model directory — config, safetensors weights, tokenizer with its
chat template — in the model cache:

    model_path("SmolLM2-135M-Instruct.Q4_1.gguf")
    # -> ~/.cache/specdec/models/SmolLM2-135M-Instruct.Q4_1-<key>  (converted on first use)

The key digests the file's resolved path, size and modification time, so a
restart finds the directory again without reading the file, and a replaced
file is converted anew. ``SPECDEC_MODEL_CACHE`` moves the cache.

What loads (checked before any conversion, each refusal one line naming the
file and what is wrong with it):

- architectures: those transformers' GGUF loader maps (``GGUF_ARCHITECTURES``:
  llama, mistral, qwen2, qwen3, gemma2/3, phi3, starcoder2, ...);
- tensor types: F32, F16, BF16 and every block quantization the ``gguf``
  package dequantizes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K–Q6_K,
  the IQ types, TQ1_0/TQ2_0, MXFP4); others (Q8_1, Q8_K, integer tensors) are
  refused by name;
- the file must hold every tensor its header lists (a truncated download is
  refused with the byte counts).

Served weights are the dequantized values, in float32 unless ``--dtype`` says
otherwise: greedy output is identical to plain decoding of those same weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

GGUF_MAGIC = b"GGUF"
CACHE_ENV = "SPECDEC_MODEL_CACHE"
SOURCE_FILE = "specdec-source.json"     # in a converted directory: the GGUF file it came from
# types stored as plain floats; every other type must be one the gguf package dequantizes
_FLOAT_TYPES = ("F32", "F16", "BF16")
# GGUF architecture names transformers' loader knows by another spelling
_ARCH_ALIASES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}


class GgufError(ValueError):
    """A GGUF file that cannot be served; the message is one line naming the file."""


def is_gguf(path: str | os.PathLike) -> bool:
    """True for a file that starts with GGUF's magic bytes."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specdec" / "models"


def converted_dir(path: str | os.PathLike) -> Path:
    """Where the directory converted from the GGUF file ``path`` lives (or will)."""
    p = Path(path).resolve()
    st = p.stat()
    key = hashlib.sha256(f"{p}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / f"{p.stem}-{key}"


def model_path(path: str | os.PathLike) -> Path:
    """A model directory for ``path``: the directory itself, or for a GGUF file its
    converted directory, converted on first use. Raises ``GgufError``."""
    p = Path(path)
    if not is_gguf(p):
        return p
    out = converted_dir(p)
    if not (out / "config.json").is_file():
        convert(p, out)
    return out


def source_of(directory: str | os.PathLike) -> str | None:
    """The GGUF file a converted directory came from (what servers report as the
    model's name); None for any other directory."""
    marker = Path(directory) / SOURCE_FILE
    if not marker.is_file():
        return None
    return json.loads(marker.read_text()).get("file")


def _architectures() -> set[str]:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}


def check(path: str | os.PathLike) -> None:
    """``GgufError`` (one line) unless the file is whole, of an architecture
    transformers' GGUF loader maps, and every tensor type in it can be dequantized."""
    import gguf
    import numpy as np

    p = Path(path)
    name = p.name
    try:
        reader = gguf.GGUFReader(p)
    except Exception as e:       # the gguf package raises what numpy raises on a short or garbled file
        size = p.stat().st_size
        raise GgufError(f"GGUF file {name} cannot be read ({size} bytes; truncated or not GGUF): "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")) from None
    size = p.stat().st_size
    needed = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    if needed > size:
        raise GgufError(f"GGUF file {name} is truncated: its tensors need {needed} bytes, the file has {size}")
    field = reader.get_field("general.architecture")
    if field is None:
        raise GgufError(f"GGUF file {name} names no general.architecture")
    arch = field.contents()
    supported = _architectures()
    if _ARCH_ALIASES.get(arch, arch) not in supported:
        raise GgufError(f"GGUF file {name}: architecture {arch!r} cannot be loaded (transformers' GGUF loader "
                        f"knows {', '.join(sorted(supported))})")
    seen: set[str] = set()
    for tensor in reader.tensors:
        qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
        if qtype.name in seen or qtype.name in _FLOAT_TYPES:
            continue
        seen.add(qtype.name)
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        try:
            gguf.quants.dequantize(np.asarray(tensor.data).reshape(-1).view(np.uint8)[:nbytes], qtype)
        except (NotImplementedError, ValueError, TypeError, KeyError):
            raise GgufError(f"GGUF file {name}: tensor type {qtype.name} (in {tensor.name}) cannot be "
                            f"dequantized by the gguf package") from None


def convert(path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Dequantize the GGUF file ``path`` into the model directory ``out`` (config,
    float32 safetensors, tokenizer). Written beside ``out`` and renamed into place,
    so an interrupted conversion leaves nothing that looks finished."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    p, out = Path(path), Path(out)
    check(p)
    logging.disable_progress_bar()           # a service log, not a terminal
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
            model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)
        except (ValueError, NotImplementedError, KeyError) as e:
            raise GgufError(f"GGUF file {p.name} cannot be loaded: {str(e).splitlines()[0]}") from None
        # the weights are dequantized floats now: saved as an ordinary checkpoint (tied
        # embeddings written once under their usual name, as save_pretrained does)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.dtype = torch.float32
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps({"file": str(p.resolve()), "size": p.stat().st_size}) + "\n")
        if out.exists():                # converted meanwhile by another process: keep theirs
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
