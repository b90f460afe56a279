"""EAGLE-3 drafter: the EAGLE-3 head (``drafter.eagle.eagle3_head``) over the target's multi-layer features.

Input t of the head is the pair (g_t, x_{t+1}). For a committed position g_t
is fc(the target's three layer features at t): the verifier returns those
features, 3 Ht wide, for every committed token (``VerifierEngine.prefill``'s
``feature_layers``, the layers this drafter reports), and they are projected
through ``fc`` as they arrive, so a session keeps H-wide rows. A tree node's
input is its parent's head output, not projected: EAGLE-3 feeds the head its
own output hidden state after the first step. Drafting ahead substitutes the
head's outputs along a likely path for the target's features, which are then
already H wide; so a commit's rows are told apart by width (3 Ht: the
target's, projected here; H: the head's own), which is why a head whose H
equals 3 Ht is refused.

The reduced vocabulary: the head's logits cover Vd draft ids; draft id d is
target id d + d2t[d]. ``logprobs`` returns target-vocabulary log-probs that
are -inf outside the draft vocabulary, so top-k children, sampled proposals
(zero mass outside the draft vocabulary) and node values all speak target ids
and the verifier's acceptance needs nothing new to stay exact.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from specdec.model.loading import torch_device
from specdec.model.quantize import quantize_linears
from specdec.request.errors import InvalidArgument
from drafter.base import DraftSession, on_device, read_value_temperature
from drafter.cached import CachedTreeDrafter
from drafter.eagle import eagle3_layouts as layouts
from drafter.eagle.eagle2 import EagleDrafter, FeatureHeadDrafter
from drafter.eagle.eagle2_head import WEIGHT_FILES, load_target_head
from drafter.eagle.eagle3_head import Eagle3Head, load_head3


class Eagle3Drafter(FeatureHeadDrafter):
    name = "eagle3"

    def __init__(self, head_dir: str | Path, target_dir: str | Path, dtype=torch.float32,
                 max_sessions: int = 64, ttl_s: float = 600.0, head: Eagle3Head | None = None,
                 device: str = "cpu", compile: str = "off", weights: str = "dtype"):
        text = AutoConfig.from_pretrained(target_dir, local_files_only=True).get_text_config(decoder=True)
        vocab, target_hidden, depth = int(text.vocab_size), int(text.hidden_size), int(text.num_hidden_layers)
        if head is None:
            head = load_head3(head_dir, dtype, target_layers=depth)
        if head.embedding is None:
            head.set_embedding(load_target_head(target_dir, dtype).embed)
        if weights == "w8a8":       # its layer and draft head read int8 per level; fc (once a commit) stays
            quantize_linears(head, weights, keep=("fc",))
        where = head_dir or "the EAGLE-3 head"
        if head.t2d.numel() != vocab:
            raise InvalidArgument(f"{where}: vocabulary of {head.t2d.numel()} tokens, the target has {vocab}")
        if head.fc.in_features != 3 * target_hidden:
            raise InvalidArgument(f"{where}: fc reads {head.fc.in_features} features, 3 layers of the "
                                  f"target's {target_hidden} make {3 * target_hidden}")
        if head.fc.in_features == head.config.hidden_size:
            raise InvalidArgument(f"{where}: a head {head.config.hidden_size} wide over 3 x {target_hidden} "
                                  f"features cannot tell the target's features from its own")
        # a head built without layers reads the reference's; either way they must exist in this target
        layers = layouts.feature_layers({"eagle_aux_hidden_state_layer_ids": list(head.layers)}, depth)
        target_ids = head.to_target_ids(torch.arange(head.draft_vocab_size))
        if (target_ids.min() < 0 or target_ids.max() >= vocab
                or target_ids.unique().numel() != target_ids.numel()):
            raise InvalidArgument(f"{where}: d2t does not map the draft vocabulary to distinct target ids")
        super().__init__(vocab_size=vocab, max_sessions=max_sessions, ttl_s=ttl_s,
                         greedy_value_temperature=read_value_temperature(head_dir))
        self.device = torch_device(device)
        self.head = head.to(self.device)
        self.target_ids = target_ids.to(self.device)        # [Vd] draft id -> target id
        self.feature_layers = layers                        # asked of the verifier (HF hidden-state indices)
        self.feature_size = head.fc.in_features             # 3 Ht: a feature row on the wire
        self.hidden_size = head.config.hidden_size
        self.use_compile(compile)

    def step_tensors(self) -> dict[str, torch.Tensor]:
        return {"embedding": self.head.embedding, "target_ids": self.target_ids}

    def reading(self, tensors: dict[str, torch.Tensor]) -> Eagle3Drafter:
        view = copy.copy(self)              # the embedding is the head's own buffer, read through the head
        view.target_ids = tensors["target_ids"]
        return view

    def logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target-vocabulary log-probs [..., V] of head outputs [..., H]: the draft
        distribution placed at its target ids, -inf elsewhere."""
        draft = torch.log_softmax(self.head.draft_logits(hidden), dim=-1)          # [..., Vd]
        out = draft.new_full((*draft.shape[:-1], self.vocab_size), -math.inf)
        out[..., self.target_ids] = draft
        return out

    def _append(self, sess: DraftSession, tokens: list[int], features, first: bool) -> None:
        # the target's rows are projected on arrival; rows already H wide are the head's own (module doc)
        if features is not None and features.ndim == 2 and features.shape[1] == self.feature_size:
            with torch.inference_mode():
                features = self.head.project(on_device(features, self.device)).float()
        elif features is not None and features.ndim == 2 and features.shape[1] != self.hidden_size:
            raise InvalidArgument(f"EAGLE-3 drafter needs features [n, {self.feature_size}] (target layers "
                                  f"{list(self.feature_layers)}), got {tuple(features.shape)}")
        super()._append(sess, tokens, features, first)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The target's embedding rows of ``tokens`` (held by the head)."""
        return self.head.embed_tokens(tokens)


def is_eagle3_head(directory: str | Path) -> bool:
    """Whether ``directory`` holds an EAGLE-3 head (by its config, else by its tensor names)."""
    directory = Path(directory)
    cfg = directory / "config.json"
    if cfg.is_file() and layouts.is_eagle3_config(json.loads(cfg.read_text())):
        return True
    weights = directory / WEIGHT_FILES[0]
    if weights.is_file():
        with safe_open(weights, "pt") as f:
            return layouts.is_eagle3_keys(f.keys())
    return False


def load_eagle_drafter(head_dir: str | Path, target_dir: str | Path, weights: str = "dtype",
                       **kwargs) -> CachedTreeDrafter:
    """The drafter for an EAGLE head directory of any version: EAGLE-3 or EAGLE-1/2;
    ``weights`` (``--weights``): w8a8 quantizes an EAGLE-3 head's layer and draft
    head (an EAGLE-1/2 head drafts through the target's output matrix: as loaded)."""
    if is_eagle3_head(head_dir):
        return Eagle3Drafter(head_dir, target_dir, weights=weights, **kwargs)
    return EagleDrafter(head_dir, target_dir, **kwargs)
