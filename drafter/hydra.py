"""Hydra heads as a drafter (``drafter.hydra_heads`` for the heads and their layout).

Reference: Ankner et al., Hydra (arXiv:2402.05109).

The root of every tree is the verifier's bonus token, produced from the
target's final-norm hidden state h_t: the feature the verifier ships for the
last committed token (the one Medusa and EAGLE-1/2 read). Head d predicts the
token at depth d + 1 from h_t and the target's input embeddings of the node's
own path (root first), so unlike Medusa the proposals depend on the path: the
tree is drafted level by level, each frontier node at depth d expanded by head
d fed with its path, in one heads call per level. The tree is as deep as there
are heads. The embedding table is read from the target directory (only it and
the output head's names are looked up, as for EAGLE).

Hydra++ heads (``hydra_head_arch`` "prefix-mlp", ``drafter.hydra_prefix``)
read the prefix layer's output at the root's hidden state instead of h_t: the
layer runs over every committed hidden state of the session, its KV cache
(``sess.cache``, ``sess.fed`` of the session's hidden states fed) only ever
holds committed ones: new ones are fed at the next draft, and a rollback
truncates it like any model drafter's cache (``Drafter.rollback``), the
root's input fed again.

Trees: "eagle2" (the bench's ``hydra``), "static" (Medusa's ``mc_sim_7b_63``
by default, the bench's ``hydra-static``), "chain", "no-value", "no-rerank".

Acceptance is the project's exact one: greedy sessions accept the target's
argmax; sampled sessions draw children from the head's distribution for that
node (the q each node's children were drawn from ships with the tree) and the
verifier runs recursive rejection sampling, or, with top proposals, one-hot
drafts with residual resampling. Constrained sessions are masked along each
node's path (``masked_expand``).

Concurrent sessions batched by ``drafter.batch`` share the first level
(``prepare``): the prefix layer's feed of every session's new hidden states
(one padded forward) and head 0 over each session's (feature, root), one
heads call, neither of which depends on a tree. The deeper levels read each
session's own drafted paths and are drafted one session after another.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from specdec.model import kv
from specdec.model.loading import torch_device
from specdec.request.params import TreeParams
from specdec.request.tree_shapes import MEDUSA_MC_SIM_7B_63, Shape
from specdec.tree.build import DraftTree, Frontier, build_tree
from specdec.tree.grammar import masked_expand
from drafter.base import Drafter, DraftSession, read_value_temperature
from drafter.hydra_heads import HydraHeads, HydraLoadError, check_fits, load_heads
from drafter.hydra_prefix import feed


class HydraDrafter(Drafter):
    name = "hydra"
    needs_features = True           # the target's final-norm hidden state (feature_layers: none)
    samples_proposals = True
    feature_layers: tuple[int, ...] = ()

    def __init__(self, heads_dir: str | Path, target_dir: str | Path | None = None, dtype=torch.float32,
                 max_sessions: int = 64, ttl_s: float = 600.0, heads: HydraHeads | None = None,
                 device: str = "cpu", static_shape: Shape | None = None, embed: torch.Tensor | None = None):
        """``embed``: the target's input embedding [V, H], read from ``target_dir``
        when not given. Raises HydraLoadError (one line) when the heads do not fit."""
        if heads is None:
            heads = load_heads(heads_dir, dtype, None if target_dir is None else _target_config(target_dir))
        if embed is None:
            if target_dir is None:
                raise ValueError("HydraDrafter needs the target's directory or its input embedding")
            from drafter.eagle.eagle2_head import load_target_head

            embed = load_target_head(target_dir, dtype).embed
        vocab, hidden = embed.shape
        check_fits(heads, hidden, vocab, heads_dir)
        super().__init__(vocab_size=vocab, max_sessions=max_sessions, ttl_s=ttl_s,
                         greedy_value_temperature=read_value_temperature(heads_dir))
        self.device = torch_device(device)
        self.heads = heads.to(self.device)
        self.embed = embed.to(self.device, heads.hydra_lm_head[0].weight.dtype)
        self.hidden_size = self.feature_size = hidden
        self.static_shape = static_shape if static_shape is not None else MEDUSA_MC_SIM_7B_63

    @property
    def num_heads(self) -> int:
        return self.heads.num_heads

    def session_config(self, sess: DraftSession, cfg: TreeParams) -> TreeParams:
        """The base's, as deep as there are heads at most; a static tree without
        a shape of its own takes the drafter's."""
        cfg = super().session_config(sess, cfg)
        if cfg.depth > self.num_heads:
            cfg = replace(cfg, depth=self.num_heads)
        if cfg.method == "static" and cfg.static_shape is None:
            cfg = replace(cfg, static_shape=self.static_shape)
        return cfg

    def new_cache(self):
        """A session's prefix-layer KV cache (prefix-mlp heads)."""
        return kv.new_cache(self.heads.prefix.config)

    def _inputs_for(self, n_tokens: int) -> int:
        return n_tokens - 1             # the prefix layer's inputs: the hidden states before the root

    @torch.inference_mode()
    def head_logprobs(self, depth: int, feature: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:
        """feature [H] or [f, H] (what the heads read for the root: h_t, or the
        prefix layer's output at it), paths [f, depth + 1] token ids root first
        -> log-probs [f, V] of each path's next token (head ``depth``)."""
        paths = paths.to(self.device)
        hidden = feature.to(self.device).expand(len(paths), -1)
        return self.heads.logprobs(depth, hidden, torch.nn.functional.embedding(paths, self.embed)).cpu()

    def first_levels(self, sessions: list[DraftSession]) -> None:
        """Each listed session's first level where it is stale (``sess.state``:
        the feature its heads read, head 0's log-probs [V] for the root's
        children): the prefix layer fed with the new hidden states of all of
        them in one forward, then head 0 for all of them in one call."""
        stale = [s for s in sessions if s.state is None]
        if not stale:
            return
        if self.heads.prefix is not None:
            feeding = [s for s in stale if s.root_out is None or s.fed < len(s.features)]
            if feeding:
                feed(self.heads.prefix, feeding, self.new_cache)
            features = torch.stack([s.root_out[0] for s in stale])
        else:
            features = torch.stack([s.features[-1] for s in stale])
        logp = self.head_logprobs(0, features, torch.tensor([[s.tokens[-1]] for s in stale]))
        for sess, feature, row in zip(stale, features, logp):
            sess.state = (feature, row)

    def prepare(self, sids: list[str]) -> None:
        """The first level of every listed session that lacks it, batched
        (``first_levels``; sessions that are gone are left to fail when drafted)."""
        with self.locked(sids) as sessions:
            self.first_levels(sessions)

    def draft_session(self, sess: DraftSession, cfg: TreeParams) -> DraftTree:
        self.first_levels([sess])        # (a second draft with nothing committed since reuses it)
        feature, first = sess.state
        paths: dict[int, torch.Tensor] = {0: torch.tensor([sess.tokens[-1]])}   # pool id -> its path, root first

        def expand(frontier: Frontier) -> torch.Tensor:
            if frontier.depth == 0:
                return first[None]
            rows = []
            for node, token, parent in zip(frontier.nodes.tolist(), frontier.tokens.tolist(),
                                           frontier.parents.tolist()):
                prefix = paths[parent] if parent >= 0 else torch.zeros(0, dtype=torch.int64)
                paths[node] = torch.cat([prefix, torch.tensor([token])])
                rows.append(paths[node])
            return self.head_logprobs(frontier.depth, feature, torch.stack(rows))

        if sess.grammar is not None:     # a constrained session: each node's children masked along its own path
            expand = masked_expand(expand, sess.grammar)
        return build_tree(sess.tokens[-1], expand, cfg, self.proposal_sampler(sess, cfg))

    def _append(self, sess: DraftSession, tokens, features, first: bool) -> None:
        super()._append(sess, tokens, features, first)
        sess.state = None                # the root moved: its first level is stale


def load_hydra_drafter(heads_dir: str | Path, target_dir: str | Path, dtype=torch.float32, device: str = "cpu",
                       static_shape: Shape | None = None, **sessions) -> HydraDrafter:
    """The drafter for the heads at ``heads_dir`` over the target at ``target_dir``;
    HydraLoadError (one line) when they do not fit."""
    if not Path(target_dir, "config.json").is_file():
        raise HydraLoadError(f"target directory {target_dir} has no config.json")
    heads = load_heads(heads_dir, dtype, _target_config(target_dir))
    try:
        return HydraDrafter(heads_dir, target_dir, dtype=dtype, device=device, static_shape=static_shape,
                            heads=heads, **sessions)
    except HydraLoadError:
        raise
    except Exception as exc:            # the target's embedding could not be read
        raise HydraLoadError(f"target directory {target_dir}: {str(exc).splitlines()[0]}") from None


def _target_config(target_dir: str | Path):
    """The target's transformers config (a prefix-mlp head's decoder layer is shaped by it)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(target_dir, local_files_only=True)
    except Exception as exc:            # noqa: BLE001 - named in one line
        raise HydraLoadError(f"target directory {target_dir}: {str(exc).splitlines()[0]}") from None
