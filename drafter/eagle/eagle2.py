"""EAGLE-2 drafter: a feature-level head over the target's features.

Input t of the head is the pair (f_t, x_{t+1}); committed pairs live in the
head's KV cache. A tree node at depth d takes its parent's head output as its
feature (the head predicts the target's next feature) and sits at position
root_pos + d.
"""

from __future__ import annotations

import copy
import dataclasses
from abc import abstractmethod
from pathlib import Path

import torch

from specdec.model import kv, masks
from specdec.model import prefix_cache as pc
from specdec.model.loading import torch_device
from drafter.base import DraftSession, on_device, read_value_temperature
from drafter.cached import CachedTreeDrafter
from drafter.eagle.eagle2_head import TargetHead, load_head, load_target_head


class FeatureHeadDrafter(CachedTreeDrafter):
    """A drafter whose ``head`` reads (token embedding, feature) pairs over one
    full-attention layer (EAGLE-1/2 and EAGLE-3): feeding committed pairs and
    stepping tree nodes; a subclass says how tokens are embedded (``embed_tokens``)
    and how head outputs become log-probs (``logprobs``)."""

    needs_features = True
    compiled = None          # drafter.compiled.head_levels.CompiledHead: compiled draft levels (None: eager)
    compiled_tree = None     # drafter.compiled.whole_draft.CompiledTree: the default budget's whole draft (None: none)

    def new_cache(self):
        return kv.new_cache(self.head.config) if self.compiled is None else self.compiled.new_cache()

    def use_compile(self, mode: str) -> None:
        """``--compile MODE`` for the draft levels (``drafter.compiled.head_levels``)
        and the default budget's whole draft (``drafter.compiled.whole_draft``)."""
        from drafter.compiled.head_levels import compile_head
        from drafter.compiled.whole_draft import compile_tree

        self.compiled = compile_head(self, mode)
        self.compiled_tree = compile_tree(self.compiled)

    def draft_whole(self, cache, root_token, root_hidden, root_logp, cfg, fallback=None):
        tree = self.compiled_tree
        if tree is None or not tree.serves(cfg, kv.seq_len(cache)):
            return None
        return tree.draft(cache, root_token, root_hidden, root_logp, cfg.value_temperature or 1.0,
                          min(cfg.depth, cfg.total_tokens - 1), fallback)

    @abstractmethod
    def step_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors a draft level reads besides the head's own parameters, by name."""

    @abstractmethod
    def reading(self, tensors: dict[str, torch.Tensor]) -> FeatureHeadDrafter:
        """A shallow copy of this drafter whose draft levels read ``tensors``
        (``step_tensors``' names) instead: a compiled level traces it over its
        own named buffers, which a package binds at load."""

    def _inputs_for(self, n_tokens: int) -> int:
        return n_tokens - 1

    @abstractmethod
    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The head's token input for ``tokens``: the target's embedding rows."""

    def feed_pending(self, sess: DraftSession, end: int | None = None):
        start, end = sess.fed, len(sess.tokens) - 1 if end is None else end     # pairs (feature_t, x_{t+1})
        dev = self.device
        fresh = sess.fresh
        if fresh is not None and fresh[0] == start and fresh[1].shape[0] == end - start:   # fed as it came
            feats, ids = on_device(fresh[1], dev), fresh[2]
        else:
            feats, ids = on_device(torch.stack(sess.features[start:end]), dev), None  # the rows stay where they are
        done = None
        if self.compiled is not None and kv.seq_len(sess.cache) == start:
            # the new pairs see every fed one and each other causally: a compiled level where one applies,
            # its inputs made on the device
            done = self.compiled.feed(sess.cache, sess.tokens[start + 1:end + 1], feats, ids)
        sess.fed = end
        if done is not None:
            return done[0][-1], done[1][-1]
        tokens = ids if ids is not None else torch.tensor(sess.tokens[start + 1:end + 1], dtype=torch.long,
                                                          device=dev)
        positions = torch.arange(start, end, device=dev)
        out = self.head(self.embed_tokens(tokens)[None], feats[None], positions[None], None, sess.cache)[0]
        return out[-1], self.logprobs(out[-1])

    def block_contents(self, sess: DraftSession, inputs: int):
        # input t is (f_t, x_{t+1}): block j's K/V needs the tokens up to x_{(j+1)B} and the features
        # before f_{(j+1)B}, and its key digests exactly those pairs
        block = self.prefix.block
        for a in range(0, inputs - block + 1, block):
            feats = torch.stack(sess.features[a:a + block]).cpu().numpy().tobytes()
            yield pc.token_bytes(sess.tokens[a + 1:a + block + 1]) + feats

    def step(self, sess, tokens, parent_hidden, positions, allowed, key_positions):
        out = None if self.compiled is None else self.compiled.step(sess.cache, tokens, parent_hidden, positions,
                                                                     allowed)
        return self.eager_step(sess.cache, tokens, parent_hidden, positions, allowed) if out is None else out

    def level_step(self, sess, tokens, parent_hidden, positions, allowed, key_positions):
        """``step`` with every input on the device already (``specdec.tree.drawn``)."""
        out = None if self.compiled is None else self.compiled.step(sess.cache, tokens, parent_hidden, positions,
                                                                     allowed, resident=True)
        return self.eager_step(sess.cache, tokens, parent_hidden, positions, allowed, resident=True) \
            if out is None else out

    def eager_step(self, cache, tokens, parent_hidden, positions, allowed, resident: bool = False):
        """One draft level run eagerly: (outputs [k, H], log-probs [k, V]);
        ``resident``: the inputs are on the device already."""
        dev = self.device
        mask = masks.additive(allowed, self.head.fc.weight.dtype)[None, None]      # one full-attention layer
        if not resident:
            tokens, positions, mask, parent_hidden = tokens.to(dev), positions.to(dev), mask.to(dev), \
                parent_hidden.to(dev)
        out = self.head(self.embed_tokens(tokens)[None], parent_hidden[None], positions[None], mask, cache)[0]
        return out, self.logprobs(out)


class EagleDrafter(FeatureHeadDrafter):
    name = "eagle"
    feature_layers: tuple[int, ...] = ()     # the target's final hidden state (VerifierEngine.prefill)

    def __init__(self, head_dir: str | Path, target_dir: str | Path, dtype=torch.float32,
                 max_sessions: int = 64, ttl_s: float = 600.0, head=None, target_head: TargetHead | None = None,
                 device: str = "cpu", compile: str = "off"):
        if head is None:
            head = load_head(head_dir, dtype)
        if target_head is None:
            target_head = load_target_head(target_dir, dtype)
        embed = target_head.embed
        if embed.shape[1] != head.config.hidden_size:
            raise ValueError(f"EAGLE head hidden size {head.config.hidden_size} does not match the "
                             f"target's {embed.shape[1]}")
        super().__init__(vocab_size=embed.shape[0], max_sessions=max_sessions, ttl_s=ttl_s,
                         greedy_value_temperature=read_value_temperature(head_dir))
        self.device = torch_device(device)
        self.head, self.target_head = head.to(self.device), target_head.to(self.device)
        self.hidden_size = self.feature_size = embed.shape[1]
        self.use_compile(compile)

    def step_tensors(self) -> dict[str, torch.Tensor]:
        return {"embed": self.target_head.embed, "lm_head": self.target_head.lm_head}

    def reading(self, tensors: dict[str, torch.Tensor]) -> EagleDrafter:
        view = copy.copy(self)
        view.target_head = dataclasses.replace(self.target_head, embed=tensors["embed"], lm_head=tensors["lm_head"])
        return view

    def logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Log-probs [..., V] of the model's outputs [..., H], its own final-logit processing included."""
        return torch.log_softmax(self.target_head.logits(hidden), dim=-1)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The target's embedding rows of ``tokens``: the head's token input."""
        return self.target_head.embed_tokens(tokens)
