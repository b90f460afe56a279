"""Hydra heads and the reference checkpoint layout.

Reference: Ankner et al., "Hydra: Sequentially-Dependent Draft Heads for
Medusa Decoding" (2024), https://arxiv.org/abs/2402.05109.

Head i (0-based) predicts the token at depth i + 1 below the tree's root from
concat(h_t, E(root), E(x_1), ..., E(x_i)): h_t the target's final-norm hidden
state that produced the root, E the target's input embedding, x_1..x_i the
path drafted below the root so far. The input [H * (i + 2)] goes through a
first residual block that also narrows it, y = R x + SiLU(W x + b) (R a
linear map with bias), then ``num_layers - 1`` blocks y = x + SiLU(W x + b),
then a per-head vocabulary projection with bias.

Layout (zankner/Hydra, the "mlp" head arch with grounded heads):
``hydra_lm_head.safetensors`` or ``hydra_lm_head.pt``, keys
``hydra_mlp.{i}.0.linear.weight|bias``, ``hydra_mlp.{i}.0.res_connection.weight|bias``,
``hydra_mlp.{i}.{l}.linear.weight|bias`` (0 < l < L) and
``hydra_lm_head.{i}.weight|bias``; config.json ``hydra_num_heads``,
``hydra_num_layers``, ``hydra_head_arch``. The Hydra++ arch "prefix-mlp"
(a one-layer decoder over the target's hidden states feeding the heads,
``prefix_embeding_layer``) is refused at load: it needs its own KV cache over
the context, which this drafter does not keep.

Everything that does not fit is refused here, in one line naming it
(``HydraLoadError``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from specdec.request.errors import InvalidArgument
from drafter.medusa_heads import read_state

FILES = ("hydra_lm_head.safetensors", "hydra_lm_head.pt")
ARCHS = ("mlp",)
_KEY = re.compile(r"hydra_mlp\.(\d+)\.(\d+)\.(linear|res_connection)\.(weight|bias)"
                  r"|hydra_lm_head\.(\d+)\.(weight|bias)")


class HydraLoadError(InvalidArgument):
    """Heads that cannot serve this target, named in one line."""


class HydraBlock(nn.Module):
    """y = res(x) + SiLU(linear(x)); ``res`` a linear map when the block narrows ``inputs`` to ``hidden``."""

    def __init__(self, inputs: int, hidden: int):
        super().__init__()
        self.linear = nn.Linear(inputs, hidden)
        self.res_connection = nn.Linear(inputs, hidden) if inputs != hidden else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.res_connection(x) + nn.functional.silu(self.linear(x))


class HydraHeads(nn.Module):
    """``num_heads`` sequentially dependent heads: head i reads H * (i + 2) inputs."""

    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int = 1):
        super().__init__()
        if num_layers < 1:
            raise ValueError("Hydra heads need at least one layer")
        self.hidden, self.vocab, self.num_layers = hidden, vocab, num_layers
        self.hydra_mlp = nn.ModuleList(
            nn.Sequential(HydraBlock(hidden * (i + 2), hidden), *[HydraBlock(hidden, hidden)
                                                                 for _ in range(num_layers - 1)])
            for i in range(num_heads))
        self.hydra_lm_head = nn.ModuleList(nn.Linear(hidden, vocab) for _ in range(num_heads))

    @property
    def num_heads(self) -> int:
        return len(self.hydra_lm_head)

    def head(self, i: int, hidden: torch.Tensor, path_embeds: torch.Tensor) -> torch.Tensor:
        """Head i's logits [..., V]: hidden [..., H], path_embeds [..., i + 1, H] (root first)."""
        dtype = self.hydra_lm_head[i].weight.dtype
        x = torch.cat([hidden[..., None, :], path_embeds], dim=-2).to(dtype).flatten(-2)
        return self.hydra_lm_head[i](self.hydra_mlp[i](x))

    def logprobs(self, i: int, hidden: torch.Tensor, path_embeds: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.head(i, hidden, path_embeds).float(), dim=-1)

    def teacher_forced(self, hidden: torch.Tensor, embeds: torch.Tensor) -> list[torch.Tensor]:
        """Training view: hidden [B, L, H] (position t), embeds [B, L, H] of the
        tokens; head i at t reads E(tokens[t + 1 .. t + 1 + i]) -> logits
        [B, L - 1 - i, V] for positions t < L - 1 - i."""
        out = []
        length = hidden.shape[1]
        for i in range(self.num_heads):
            n = length - 1 - i
            if n <= 0:
                break
            path = torch.stack([embeds[:, 1 + j: 1 + j + n] for j in range(i + 1)], dim=-2)   # [B, n, i+1, H]
            out.append(self.head(i, hidden[:, :n], path))
        return out


def _config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise HydraLoadError(f"{path} is not valid JSON ({exc})") from None
    return config if isinstance(config, dict) else {}


def _count(indices, what: str, where: Path) -> int:
    found = sorted(set(indices))
    if found != list(range(len(found))):
        missing = next(i for i in range(len(found) + 1) if i not in found)
        raise HydraLoadError(f"{where}: {what} {missing} is missing (found {found})")
    return len(found)


def load_heads(directory: str | Path, dtype=torch.float32) -> HydraHeads:
    """Hydra heads from the reference layout; HydraLoadError (one line) when
    they do not make a consistent set of "mlp" heads."""
    directory = Path(directory)
    if not directory.is_dir():
        raise HydraLoadError(f"Hydra heads directory {directory} does not exist")
    config = _config(directory)
    arch = config.get("hydra_head_arch", "mlp")
    if arch not in ARCHS:
        raise HydraLoadError(f"{directory}: hydra_head_arch {arch!r} is not supported (supported: "
                             f"{', '.join(ARCHS)}; prefix-mlp's decoder layer needs a KV cache this drafter lacks)")
    if config.get("grounded_heads") is False:
        raise HydraLoadError(f"{directory}: grounded_heads false (Medusa-style heads): load them with --medusa")
    path = next((directory / n for n in FILES if (directory / n).is_file()), None)
    if path is None:
        raise HydraLoadError(f"{directory} is not a Hydra heads directory (no {' nor '.join(FILES)})")
    state = {k.removeprefix("hydra_head."): v for k, v in read_state(path, HydraLoadError).items()}
    unknown = sorted(k for k in state if not _KEY.fullmatch(k))
    if unknown:
        raise HydraLoadError(f"{path}: unexpected keys for the Hydra mlp layout: {', '.join(unknown[:4])}")
    matches = [_KEY.fullmatch(k) for k in state]
    heads = _count((int(m[5]) for m in matches if m[5] is not None), "head", path)
    if heads == 0:
        raise HydraLoadError(f"{path}: no Hydra heads in the weights (head count 0)")
    want_heads = config.get("hydra_num_heads")
    if want_heads is not None and int(want_heads) != heads:
        raise HydraLoadError(f"{path}: config says hydra_num_heads {want_heads}, the weights hold {heads} heads")
    layers = _count((int(m[2]) for m in matches if m[1] is not None), "layer", path)
    if layers == 0:
        raise HydraLoadError(f"{path}: no Hydra head layers in the weights")
    want_layers = config.get("hydra_num_layers")
    if want_layers is not None and int(want_layers) != layers:
        raise HydraLoadError(f"{path}: config says hydra_num_layers {want_layers}, the weights hold {layers}")
    lm = state.get("hydra_lm_head.0.weight")
    if lm is None or lm.ndim != 2:
        raise HydraLoadError(f"{path}: head 0's vocabulary projection hydra_lm_head.0.weight is missing or not [V, H]")
    vocab, hidden = lm.shape
    module = HydraHeads(hidden, vocab, heads, layers)
    expected = module.state_dict()
    missing = [k for k in expected if k not in state]
    if missing:
        raise HydraLoadError(f"{path}: missing key {missing[0]}")
    extra = [k for k in state if k not in expected]
    if extra:
        raise HydraLoadError(f"{path}: key {extra[0]} fits no head of the layout")
    for key, want in expected.items():
        if state[key].shape != want.shape:
            raise HydraLoadError(f"{path}: {key} has shape {tuple(state[key].shape)}, expected {tuple(want.shape)} "
                                 f"(hidden size {hidden}, vocabulary {vocab}, {heads} heads)")
    module.load_state_dict({k: v.float() for k, v in state.items()})
    return module.to(dtype).eval()


def check_fits(heads: HydraHeads, hidden: int, vocab: int, where: str | Path) -> None:
    """HydraLoadError unless the heads read a target of width ``hidden`` and vocabulary ``vocab``."""
    if heads.hidden != hidden:
        raise HydraLoadError(f"{where}: Hydra heads' hidden size {heads.hidden} does not match the target's {hidden}")
    if heads.vocab != vocab:
        raise HydraLoadError(f"{where}: Hydra heads' vocabulary {heads.vocab} does not match the target's {vocab}")


def save_heads(heads: HydraHeads, directory: str | Path, dtype=torch.float32) -> None:
    """Write ``heads`` in the reference layout (hydra_lm_head.safetensors + config.json)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in heads.state_dict().items()}
    save_file(state, directory / "hydra_lm_head.safetensors")
    config = {"hydra_num_heads": heads.num_heads, "hydra_num_layers": heads.num_layers, "hydra_head_arch": "mlp",
              "grounded_heads": True, "hidden_size": heads.hidden, "vocab_size": heads.vocab}
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
