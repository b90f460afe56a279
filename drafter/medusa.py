"""Medusa heads as a drafter (``drafter.medusa_heads`` for the heads and their layouts).

Reference: Cai et al., Medusa (arXiv:2401.10774).

The root of every tree is the verifier's bonus token x_{t+1}, produced from
the target's final-norm hidden state f_t: the feature the verifier ships for
the last committed token (the same vector an EAGLE-1/2 head reads, so the
verifier needs nothing new). Head h on f_t predicts x_{t+2+h}, so the tree's
level d + 1 is drawn from head d. Medusa-1 heads do not look at the path: every
node of a level gets the same distribution, and one heads forward per draft
gives them all ([num_heads, V]); the tree is as deep as there are heads.

Trees (``specdec.tree.build``, the knobs every drafter takes):
- "eagle2": the EAGLE-2 dynamic tree over the heads' log-probs (a node's
  value is the product of its path's head probabilities; top expand_k per
  node, the global top expand_k per level expanded, then reranked). The
  bench calls it ``medusa``.
- "static": a fixed tree of rank paths; by default Medusa's own
  ``mc_sim_7b_63`` (``specdec.request.tree_shapes``), or the drafter's
  ``static_shape`` (``--medusa-choices FILE``), or the request's. The bench
  calls it ``medusa-static``.
- "chain", "no-value", "no-rerank" as for any drafter.

Acceptance is the project's exact one, never Medusa's typical acceptance
(which is not lossless): greedy sessions accept the target's argmax; sampled
sessions draw children from the head's distribution (sampled proposals,
shipped with the tree as the q each node's children were drawn from) and the
verifier runs recursive rejection sampling on them, or, with top proposals,
treats the drafts as one-hot proposals with residual resampling.

Concurrent sessions batched by ``drafter.batch`` share one heads forward
(``prepare``); their trees are then built one after another (a tree needs no
further model call).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from specdec.model.loading import torch_device
from specdec.request.params import TreeParams
from specdec.request.tree_shapes import MEDUSA_MC_SIM_7B_63, Shape
from specdec.tree.build import DraftTree, Frontier, build_tree
from specdec.tree.grammar import masked_expand
from drafter.base import Drafter, DraftSession, read_value_temperature
from drafter.medusa_heads import MedusaHeads, MedusaLoadError, check_fits, load_heads


def target_shape(target_dir: str | Path) -> tuple[int, int]:
    """(hidden size, vocabulary) of the target at ``target_dir``, from its config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(Path(target_dir), local_files_only=True).get_text_config(decoder=True)
    return int(config.hidden_size), int(config.vocab_size)


class MedusaDrafter(Drafter):
    name = "medusa"
    needs_features = True           # the target's final-norm hidden state (feature_layers: none)
    samples_proposals = True
    feature_layers: tuple[int, ...] = ()

    def __init__(self, heads_dir: str | Path, target_dir: str | Path | None = None, dtype=torch.float32,
                 max_sessions: int = 64, ttl_s: float = 600.0, heads: MedusaHeads | None = None,
                 device: str = "cpu", static_shape: Shape | None = None,
                 target: tuple[int, int] | None = None):
        """``target``: the target's (hidden size, vocabulary), read from
        ``target_dir`` when not given. Raises MedusaLoadError (one line) when
        the heads do not fit it."""
        if heads is None:
            heads = load_heads(heads_dir, dtype)
        if target is None:
            if target_dir is None:
                raise ValueError("MedusaDrafter needs the target's directory or its (hidden size, vocabulary)")
            target = target_shape(target_dir)
        hidden, vocab = target
        check_fits(heads, hidden, vocab, heads_dir)
        super().__init__(vocab_size=vocab, max_sessions=max_sessions, ttl_s=ttl_s,
                         greedy_value_temperature=read_value_temperature(heads_dir))
        self.device = torch_device(device)
        self.heads = heads.to(self.device)
        self.hidden_size = self.feature_size = hidden
        self.static_shape = static_shape if static_shape is not None else MEDUSA_MC_SIM_7B_63

    @property
    def num_heads(self) -> int:
        return self.heads.num_heads

    def session_config(self, sess: DraftSession, cfg: TreeParams) -> TreeParams:
        """The base's, as deep as there are heads at most, and a static tree
        without a shape of its own takes the drafter's."""
        cfg = super().session_config(sess, cfg)
        if cfg.depth > self.num_heads:
            cfg = replace(cfg, depth=self.num_heads)
        if cfg.method == "static" and cfg.static_shape is None:
            cfg = replace(cfg, static_shape=self.static_shape)
        return cfg

    @torch.inference_mode()
    def head_logprobs(self, feature: torch.Tensor) -> torch.Tensor:
        """feature: [..., H] the target's hidden state that produced the root ->
        log-probs [..., num_heads, V] of the tokens 1..num_heads after the root."""
        return self.heads.logprobs(feature.to(self.device), self.vocab_size).cpu()

    def prepare(self, sids: list[str]) -> None:
        """The heads' outputs of every listed session that lacks them, in one
        forward (sessions that are gone are left to fail when drafted)."""
        with self.locked(sids) as sessions:
            stale = [s for s in sessions if s.state is None and s.features]
            if stale:
                logp = self.head_logprobs(torch.stack([s.features[-1] for s in stale]))   # [n, num_heads, V]
                for sess, rows in zip(stale, logp):
                    sess.state = rows

    def draft_session(self, sess: DraftSession, cfg: TreeParams) -> DraftTree:
        if sess.state is None:           # (a second draft with nothing committed since reuses it)
            sess.state = self.head_logprobs(sess.features[-1])
        logp = sess.state                # [num_heads, V]

        def expand(frontier: Frontier) -> torch.Tensor:
            # the children of level-d nodes are at depth d + 1: head d's tokens, whatever the path
            return logp[frontier.depth].expand(len(frontier.nodes), -1)

        if sess.grammar is not None:     # a constrained session: each node's children masked along its own path
            expand = masked_expand(expand, sess.grammar)
        return build_tree(sess.tokens[-1], expand, cfg, self.proposal_sampler(sess, cfg))

    def _append(self, sess: DraftSession, tokens, features, first: bool) -> None:
        super()._append(sess, tokens, features, first)
        sess.state = None                # the root moved: the heads' outputs are stale


def load_medusa_drafter(heads_dir: str | Path, target_dir: str | Path, dtype=torch.float32, device: str = "cpu",
                        static_shape: Shape | None = None, **sessions) -> MedusaDrafter:
    """The drafter for the heads at ``heads_dir`` over the target at ``target_dir``;
    MedusaLoadError (one line) when they do not fit."""
    if not Path(target_dir, "config.json").is_file():
        raise MedusaLoadError(f"target directory {target_dir} has no config.json")
    return MedusaDrafter(heads_dir, target_dir, dtype=dtype, device=device, static_shape=static_shape, **sessions)
