"""Medusa heads and the two checkpoint layouts users hold them in.

Reference: Cai et al., "Medusa: Simple LLM Inference Acceleration Framework
with Multiple Decoding Heads" (2024), https://arxiv.org/abs/2401.10774.

Head h reads the target's last hidden state after its final norm, x [H], at
position t and predicts the token at t + 2 + h (the target's own lm_head
predicts t + 1): L residual blocks y = x + SiLU(W x + b), then a linear map to
the vocabulary without bias.

Layouts (both load; ``save_heads`` writes either):
- original (FasterDecoding/Medusa): ``medusa_lm_head.safetensors`` or
  ``medusa_lm_head.pt``, keys ``{h}.{l}.linear.weight|bias`` (l < L) and
  ``{h}.{L}.weight``; config.json ``medusa_num_heads``, ``medusa_num_layers``.
  Released configs undercount the heads (Vicuna-7B's says 2, its weights hold
  5): the heads are counted from the keys.
- vLLM: config.json ``model_type == "medusa"``, ``num_heads``,
  ``num_hidden_layers``; ``model.safetensors`` (or ``pytorch_model.bin``) with
  ``blocks.{h}.layers.{l}.weight`` (+ ``.bias``) and ``lm_heads.{h}.weight``,
  and an optional ``token_map`` [V'] when the heads cover a truncated
  vocabulary (head logit j is target token ``token_map[j]``).

Everything that does not fit is refused here, in one line naming it
(``MedusaLoadError``): a drafter never meets a bad head at its first request.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from specdec.request.errors import InvalidArgument

ORIGINAL_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
VLLM_FILES = ("model.safetensors", "pytorch_model.bin")
LAYOUTS = ("original", "vllm")
_ORIGINAL_KEY = re.compile(r"(\d+)\.(\d+)\.(linear\.)?(weight|bias)")
_VLLM_BLOCK = re.compile(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)")
_VLLM_HEAD = re.compile(r"lm_heads\.(\d+)\.weight")


class MedusaLoadError(InvalidArgument):
    """Heads that cannot serve this target, named in one line."""


class ResBlock(nn.Module):
    def __init__(self, hidden: int, bias: bool = True):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """``num_heads`` heads of ``num_layers`` ResBlocks and a vocabulary projection."""

    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int = 1, bias: bool = True,
                 token_map: torch.Tensor | None = None):
        super().__init__()
        self.hidden, self.vocab, self.num_layers = hidden, vocab, num_layers
        self.blocks = nn.ModuleList(nn.Sequential(*[ResBlock(hidden, bias) for _ in range(num_layers)])
                                    for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden, vocab, bias=False) for _ in range(num_heads))
        # target id of each head logit (a truncated vocabulary); None: the identity
        self.register_buffer("token_map", token_map, persistent=token_map is not None)

    @property
    def num_heads(self) -> int:
        return len(self.lm_heads)

    @property
    def target_vocab(self) -> int | None:
        """The vocabulary the heads' ids live in (None with a token map: any that holds its ids)."""
        return self.vocab if self.token_map is None else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., H] -> logits [..., num_heads, V'] over the heads' vocabulary."""
        x = hidden.to(self.lm_heads[0].weight.dtype)
        return torch.stack([lm(blocks(x)) for blocks, lm in zip(self.blocks, self.lm_heads)], dim=-2)

    def logprobs(self, hidden: torch.Tensor, target_vocab: int) -> torch.Tensor:
        """hidden: [..., H] -> fp32 log-probs [..., num_heads, target_vocab]
        (tokens the heads cannot name get -inf)."""
        logp = torch.log_softmax(self(hidden).float(), dim=-1)
        if self.token_map is None:
            return logp
        full = logp.new_full((*logp.shape[:-1], target_vocab), -torch.inf)
        return full.index_copy_(-1, self.token_map.to(logp.device), logp)


def read_state(path: Path, error: type[InvalidArgument] = MedusaLoadError) -> dict[str, torch.Tensor]:
    """The tensors of a heads file (``.safetensors`` or a torch-saved state
    dict); ``error`` (one line) when the file holds something else."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise error(f"{path} holds a {type(state).__name__}, not a state dict")
    return state


def _first(directory: Path, names: tuple[str, ...]) -> Path | None:
    return next((directory / n for n in names if (directory / n).is_file()), None)


def _count(indices, what: str, where: Path) -> int:
    """How many of 0..n-1 ``indices`` hold; MedusaLoadError naming a gap."""
    found = sorted(set(indices))
    if found != list(range(len(found))):
        missing = next(i for i in range(len(found) + 1) if i not in found)
        raise MedusaLoadError(f"{where}: {what} {missing} is missing (found {found})")
    return len(found)


def _no_leftovers(state: dict, used: int, where: Path) -> None:
    """MedusaLoadError when the weights hold keys no head took (``used`` of them were)."""
    if len(state) != used:
        raise MedusaLoadError(f"{where}: {len(state) - used} weight(s) fit no head of the layout "
                              f"(e.g. a bias on a vocabulary projection, or a block past it)")


def _original_state(state: dict, where: Path) -> tuple[dict, int, int, bool]:
    """Original keys -> (MedusaHeads keys, heads, layers, bias)."""
    state = {k.removeprefix("medusa_head."): v for k, v in state.items()}
    unknown = sorted(k for k in state if not _ORIGINAL_KEY.fullmatch(k))
    if unknown:
        raise MedusaLoadError(f"{where}: unexpected keys for the original Medusa layout: {', '.join(unknown[:4])}")
    parsed = [(_ORIGINAL_KEY.fullmatch(k), k) for k in state]
    heads = _count((int(m[1]) for m, _ in parsed), "head", where)
    if heads == 0:
        raise MedusaLoadError(f"{where}: no Medusa heads in the weights (head count 0)")
    layers = _count((int(m[2]) for m, _ in parsed if m[3]), "layer", where)
    bias = any(m[4] == "bias" for m, _ in parsed)
    out = {}
    for h in range(heads):
        for layer in range(layers):
            for part in ("weight",) + (("bias",) if bias else ()):
                key = f"{h}.{layer}.linear.{part}"
                if key not in state:
                    raise MedusaLoadError(f"{where}: missing key {key}")
                out[f"blocks.{h}.{layer}.linear.{part}"] = state[key]
        key = f"{h}.{layers}.weight"
        if key not in state:
            raise MedusaLoadError(f"{where}: missing key {key} (head {h}'s vocabulary projection)")
        out[f"lm_heads.{h}.weight"] = state[key]
    _no_leftovers(state, len(out), where)
    return out, heads, layers, bias


def _vllm_state(state: dict, where: Path) -> tuple[dict, int, int, bool]:
    """vLLM keys -> (MedusaHeads keys, heads, layers, bias)."""
    token_map = state.pop("token_map", None)
    unknown = sorted(k for k in state if not (_VLLM_BLOCK.fullmatch(k) or _VLLM_HEAD.fullmatch(k)))
    if unknown:
        raise MedusaLoadError(f"{where}: unexpected keys for the vLLM Medusa layout: {', '.join(unknown[:4])}")
    blocks = [_VLLM_BLOCK.fullmatch(k) for k in state if _VLLM_BLOCK.fullmatch(k)]
    heads = _count((int(m[1]) for m in blocks), "block", where) if blocks else 0
    lm_heads = _count((int(_VLLM_HEAD.fullmatch(k)[1]) for k in state if _VLLM_HEAD.fullmatch(k)), "lm_head", where)
    heads = max(heads, lm_heads)
    if heads == 0:
        raise MedusaLoadError(f"{where}: no Medusa heads in the weights (head count 0)")
    layers = _count((int(m[2]) for m in blocks), "layer", where) if blocks else 0
    bias = any(m[3] == "bias" for m in blocks)
    out = {}
    for h in range(heads):
        for layer in range(layers):
            for part in ("weight",) + (("bias",) if bias else ()):
                key = f"blocks.{h}.layers.{layer}.{part}"
                if key not in state:
                    raise MedusaLoadError(f"{where}: missing key {key}")
                out[f"blocks.{h}.{layer}.linear.{part}"] = state[key]
        key = f"lm_heads.{h}.weight"
        if key not in state:
            raise MedusaLoadError(f"{where}: missing key {key}")
        out[key] = state[key]
    _no_leftovers(state, len(out), where)
    if token_map is not None:
        out["token_map"] = token_map
    return out, heads, layers, bias


def detect_layout(directory: str | Path) -> str:
    """"original" or "vllm"; MedusaLoadError when the directory is neither."""
    directory = Path(directory)
    if not directory.is_dir():
        raise MedusaLoadError(f"Medusa heads directory {directory} does not exist")
    config = _config(directory)
    if config.get("model_type") == "medusa":
        return "vllm"
    if _first(directory, ORIGINAL_FILES) is not None:
        return "original"
    raise MedusaLoadError(f"{directory} is not a Medusa heads directory (unknown layout: neither "
                          f"{' nor '.join(ORIGINAL_FILES)} nor a config.json with model_type \"medusa\")")


def _config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise MedusaLoadError(f"{path} is not valid JSON ({exc})") from None
    return config if isinstance(config, dict) else {}


def load_heads(directory: str | Path, dtype=torch.float32) -> MedusaHeads:
    """Medusa heads from either layout; MedusaLoadError (one line) when they
    do not make a consistent set of heads."""
    directory = Path(directory)
    layout = detect_layout(directory)
    if layout == "vllm":
        path = _first(directory, VLLM_FILES)
        if path is None:
            raise MedusaLoadError(f"{directory}: vLLM Medusa layout without {' or '.join(VLLM_FILES)}")
        state, heads, layers, bias = _vllm_state(dict(read_state(path)), path)
    else:
        path = _first(directory, ORIGINAL_FILES)
        state, heads, layers, bias = _original_state(read_state(path), path)
    lm = state["lm_heads.0.weight"]
    if lm.ndim != 2:
        raise MedusaLoadError(f"{path}: head 0's vocabulary projection has shape {tuple(lm.shape)}, not [V, H]")
    vocab, hidden = lm.shape
    token_map = state.pop("token_map", None)
    if token_map is not None and (token_map.ndim != 1 or len(token_map) != vocab):
        raise MedusaLoadError(f"{path}: token_map has shape {tuple(token_map.shape)}, the heads' vocabulary is {vocab}")
    module = MedusaHeads(hidden, vocab, heads, layers, bias,
                         None if token_map is None else token_map.to(torch.int64))
    for key, want in module.state_dict().items():
        if key != "token_map" and state[key].shape != want.shape:
            raise MedusaLoadError(f"{path}: {key} has shape {tuple(state[key].shape)}, expected {tuple(want.shape)} "
                                  f"(hidden size {hidden}, vocabulary {vocab})")
    module.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    return module.to(dtype).eval()


def check_fits(heads: MedusaHeads, hidden: int, vocab: int, where: str | Path) -> None:
    """MedusaLoadError unless the heads read a target of width ``hidden`` and
    vocabulary ``vocab``."""
    if heads.hidden != hidden:
        raise MedusaLoadError(f"{where}: Medusa heads' hidden size {heads.hidden} does not match the target's {hidden}")
    if heads.token_map is None and heads.vocab != vocab:
        raise MedusaLoadError(f"{where}: Medusa heads' vocabulary {heads.vocab} does not match the target's {vocab}")
    if heads.token_map is not None and len(heads.token_map) and not 0 <= int(heads.token_map.min()) <= \
            int(heads.token_map.max()) < vocab:
        raise MedusaLoadError(f"{where}: Medusa token_map names ids outside the target's vocabulary of {vocab}")


def save_heads(heads: MedusaHeads, directory: str | Path, layout: str = "original", dtype=torch.float32) -> None:
    """Write ``heads`` in ``layout`` ("original": medusa_lm_head.safetensors;
    "vllm": model.safetensors), with its config.json."""
    from safetensors.torch import save_file

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    n, layers = heads.num_heads, heads.num_layers
    state = {}
    for key, value in heads.state_dict().items():
        value = value.detach().contiguous()
        value = value if key == "token_map" else value.to(dtype)
        m = re.fullmatch(r"blocks\.(\d+)\.(\d+)\.linear\.(weight|bias)", key)
        if layout == "original":
            if key == "token_map":
                raise ValueError("the original Medusa layout has no token_map: write the vllm layout")
            key = f"{m[1]}.{m[2]}.linear.{m[3]}" if m else f"{key.split('.')[1]}.{layers}.weight"
        elif m:
            key = f"blocks.{m[1]}.layers.{m[2]}.{m[3]}"
        state[key] = value
    has_bias = any(k.endswith("bias") for k in state)
    if layout == "original":
        config = {"medusa_num_heads": n, "medusa_num_layers": layers, "hidden_size": heads.hidden,
                  "vocab_size": heads.vocab}
        save_file(state, directory / "medusa_lm_head.safetensors")
    else:
        config = {"model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": n,
                  "num_hidden_layers": layers, "hidden_size": heads.hidden, "vocab_size": heads.vocab,
                  "truncated_vocab_size": heads.vocab, "medusa_fc_bias": has_bias}
        save_file(state, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
