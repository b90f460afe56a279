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

Layout (zankner/Hydra, grounded heads): ``hydra_lm_head.safetensors`` or
``hydra_lm_head.pt`` (keys with or without the model's ``hydra_head.``
prefix) and config.json ``hydra_num_heads``, ``hydra_num_layers``,
``hydra_head_arch`` (``HydraConfig``). Both head archs load:

- "mlp": ``hydra_mlp.{i}.0.linear.weight|bias``,
  ``hydra_mlp.{i}.0.res_connection.weight|bias``,
  ``hydra_mlp.{i}.{l}.linear.weight|bias`` (0 < l < L) and
  ``hydra_lm_head.{i}.weight|bias``.
- "prefix-mlp" (Hydra++): the same heads (their blocks between dropouts) fed
  by one extra decoder layer over the target's hidden states in place of h_t,
  ``prefix_embeding_layer.*``, with a KV cache of its own over the context
  (``drafter.hydra_prefix``: keys, the layer, its feed). Its shape is the
  target's decoder layer's, so loading these heads needs the target's config.

Everything that does not fit is refused here, in one line naming it
(``HydraLoadError``): an unknown ``hydra_head_arch``, a ``hidden_state_offset``
other than 0 (heads reading another layer's hidden state), a head or layer count
the weights do not hold, a missing or unexpected key, a shape that is not the
one the heads' width, vocabulary or the target's decoder layer implies.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from specdec.request.errors import InvalidArgument
from drafter.hydra_prefix import PrefixLayer, from_reference, prefix_config, reference_name, to_reference
from drafter.medusa_heads import read_state

FILES = ("hydra_lm_head.safetensors", "hydra_lm_head.pt")
ARCHS = ("mlp", "prefix-mlp")
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
    """``num_heads`` sequentially dependent heads: head i reads H * (i + 2) inputs;
    with ``prefix`` (a ``drafter.hydra_prefix.prefix_config``), the Hydra++
    prefix layer whose output they read in place of the target's hidden state."""

    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int = 1, prefix=None):
        super().__init__()
        if num_layers < 1:
            raise ValueError("Hydra heads need at least one layer")
        self.hidden, self.vocab, self.num_layers = hidden, vocab, num_layers
        self.hydra_mlp = nn.ModuleList(
            nn.Sequential(HydraBlock(hidden * (i + 2), hidden), *[HydraBlock(hidden, hidden)
                                                                 for _ in range(num_layers - 1)])
            for i in range(num_heads))
        self.hydra_lm_head = nn.ModuleList(nn.Linear(hidden, vocab) for _ in range(num_heads))
        self.prefix = PrefixLayer(prefix) if prefix is not None else None

    @property
    def arch(self) -> str:
        return "mlp" if self.prefix is None else "prefix-mlp"

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
        [B, L - 1 - i, V] for positions t < L - 1 - i; prefix-mlp heads read the
        prefix layer's causal pass over ``hidden`` instead."""
        out = []
        length = hidden.shape[1]
        if self.prefix is not None:
            hidden = self.prefix(hidden, torch.arange(length, device=hidden.device).expand(hidden.shape[0], -1))
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


def load_heads(directory: str | Path, dtype=torch.float32, target_config=None) -> HydraHeads:
    """Hydra heads from the reference layout; HydraLoadError (one line) when
    they do not make a consistent set of heads. ``target_config`` (the
    target's transformers config) shapes a prefix-mlp checkpoint's decoder
    layer: such heads need it."""
    directory = Path(directory)
    if not directory.is_dir():
        raise HydraLoadError(f"Hydra heads directory {directory} does not exist")
    config = _config(directory)
    arch = config.get("hydra_head_arch", "mlp")
    if arch not in ARCHS:
        raise HydraLoadError(f"{directory}: hydra_head_arch {arch!r} is not supported (supported: {', '.join(ARCHS)})")
    if arch == "prefix-mlp" and target_config is None:
        raise HydraLoadError(f"{directory}: prefix-mlp heads need the target's config (their decoder layer is shaped "
                             f"like the target's)")
    if config.get("grounded_heads") is False:
        raise HydraLoadError(f"{directory}: grounded_heads false (Medusa-style heads): load them with --medusa")
    offset = config.get("hidden_state_offset") or 0
    if offset:
        raise HydraLoadError(f"{directory}: hidden_state_offset {offset} (heads trained on the hidden state {offset} "
                             f"layers below the last) is not supported: the drafter gets the final-norm hidden state")
    path = next((directory / n for n in FILES if (directory / n).is_file()), None)
    if path is None:
        raise HydraLoadError(f"{directory} is not a Hydra heads directory (no {' nor '.join(FILES)})")
    state = {k.removeprefix("hydra_head."): v for k, v in read_state(path, HydraLoadError).items()}
    named = (lambda k: k) if arch == "mlp" else reference_name        # a key as the checkpoint names it
    if arch == "prefix-mlp":
        state = from_reference(state)
    unknown = sorted(named(k) for k in state if not _KEY.fullmatch(k) and not k.startswith("prefix."))
    if unknown:
        raise HydraLoadError(f"{path}: unexpected keys for the Hydra {arch} layout: {', '.join(unknown[:4])}")
    matches = [m for m in map(_KEY.fullmatch, state) if m is not None]
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
        raise HydraLoadError(f"{path}: head 0's vocabulary projection {named('hydra_lm_head.0.weight')} is missing "
                             f"or not [V, H]")
    vocab, hidden = lm.shape
    prefix = None
    if arch == "prefix-mlp":
        prefix = prefix_config(target_config)
        if prefix.hidden_size != hidden:
            raise HydraLoadError(f"{path}: Hydra heads' hidden size {hidden} does not match the target's "
                                 f"{prefix.hidden_size}")
    module = HydraHeads(hidden, vocab, heads, layers, prefix)
    expected = module.state_dict()
    missing = [k for k in expected if k not in state]
    if missing:
        raise HydraLoadError(f"{path}: missing key {named(missing[0])}")
    extra = [k for k in state if k not in expected]
    if extra:
        raise HydraLoadError(f"{path}: key {named(extra[0])} fits no head of the layout")
    for key, want in expected.items():
        if state[key].shape != want.shape:
            implied = (f"the target's decoder layer: hidden size {hidden}, {prefix.num_attention_heads} attention "
                       f"heads, {prefix.num_key_value_heads} KV heads, MLP width {prefix.intermediate_size}"
                       if key.startswith("prefix.") else f"hidden size {hidden}, vocabulary {vocab}, {heads} heads")
            raise HydraLoadError(f"{path}: {named(key)} has shape {tuple(state[key].shape)}, expected "
                                 f"{tuple(want.shape)} ({implied})")
    module.load_state_dict({k: v.float() for k, v in state.items()})
    return module.to(dtype).eval()


def check_fits(heads: HydraHeads, hidden: int, vocab: int, where: str | Path) -> None:
    """HydraLoadError unless the heads read a target of width ``hidden`` and vocabulary ``vocab``."""
    if heads.hidden != hidden:
        raise HydraLoadError(f"{where}: Hydra heads' hidden size {heads.hidden} does not match the target's {hidden}")
    if heads.vocab != vocab:
        raise HydraLoadError(f"{where}: Hydra heads' vocabulary {heads.vocab} does not match the target's {vocab}")


def save_heads(heads: HydraHeads, directory: str | Path, dtype=torch.float32) -> None:
    """Write ``heads`` in the reference layout (hydra_lm_head.safetensors + config.json; prefix-mlp
    heads under the reference's keys, ``drafter.hydra_prefix.to_reference``)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in heads.state_dict().items()}
    save_file(state if heads.prefix is None else to_reference(state), directory / "hydra_lm_head.safetensors")
    config = {"hydra_num_heads": heads.num_heads, "hydra_num_layers": heads.num_layers, "hydra_head_arch": heads.arch,
              "grounded_heads": True, "hidden_size": heads.hidden, "vocab_size": heads.vocab}
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
