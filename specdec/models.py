"""Loading local Hugging Face models, shared by the verifier and drafter engines.

Models come only from local directories (``from_pretrained(path)``); nothing is
fetched from a hub. The bundled demo family lives in ``specdec/demo/``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent / "demo"

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ModelSpec:
    path: str
    dtype: str = "float32"          # fp32 by default on CPU: greedy equality with plain decoding
    device: str = "cpu"
    attn_implementation: str = "sdpa"


def demo_path(name: str) -> Path:
    """Directory of a bundled demo model: tokenizer, target, eagle, draft-lm."""
    return DEMO_DIR / name


def require_model_dir(path: str | os.PathLike, what: str = "model") -> Path:
    """A local model directory with a config.json, or ValueError saying which."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{what} directory not found: {p}")
    if not (p / "config.json").is_file():
        raise ValueError(f"{what} directory {p} has no config.json")
    return p


def torch_dtype(name: str):
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, name)


def quiet_transformers() -> None:
    """No download/loading progress bars in service logs and CLI output."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def load_causal_lm(spec: ModelSpec):
    """``AutoModelForCausalLM.from_pretrained`` from a local directory, eval mode."""
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    path = require_model_dir(spec.path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype(spec.dtype), attn_implementation=spec.attn_implementation,
        local_files_only=True,
    )
    return model.to(spec.device).eval()


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(path), local_files_only=True)


def read_config(path: str | os.PathLike) -> dict:
    return json.loads((Path(path) / "config.json").read_text())
