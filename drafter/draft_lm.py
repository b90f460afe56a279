"""Standalone small causal LM drafter (classic speculative sampling, or a tree
of its top-k proposals). It shares the target's tokenizer; any causal LM
specdec can serve as a target can draft (``specdec.causal_lm``)."""

from __future__ import annotations

import torch

from drafter.base import CachedTreeDrafter, DraftSession, read_value_temperature
from specdec.causal_lm import CausalLm
from specdec.models import ModelSpec, load_causal_lm


class DraftLmDrafter(CachedTreeDrafter):
    name = "draft-lm"

    def __init__(self, spec: ModelSpec | None = None, max_sessions: int = 64, ttl_s: float = 600.0, model=None):
        self.lm = CausalLm(model if model is not None else load_causal_lm(spec))
        self.model, self.body = self.lm.model, self.lm.body
        super().__init__(vocab_size=int(self.model.config.get_text_config(decoder=True).vocab_size),
                         max_sessions=max_sessions, ttl_s=ttl_s,
                         greedy_value_temperature=read_value_temperature(spec.path if spec is not None else None))

    def new_cache(self):
        return self.lm.new_cache()

    def logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Log-probs [..., V] of the model's outputs [..., H], its own final-logit processing included."""
        return torch.log_softmax(self.lm.logits(hidden), dim=-1)

    def _run(self, sess, tokens, positions, mask):
        out = self.lm.hidden(sess.cache, tokens[None], positions[None], mask)[0]
        return out, self.logprobs(out)

    def feed_pending(self, sess: DraftSession):
        start, end = sess.fed, len(sess.tokens)
        tokens = torch.tensor(sess.tokens[start:end], dtype=torch.long)
        out, logp = self._run(sess, tokens, torch.arange(start, end), None)
        sess.fed = end
        return out[-1], logp[-1]

    def step(self, sess, tokens, parent_hidden, positions, allowed, key_positions):
        return self._run(sess, tokens, positions, self.lm.masks(allowed[None], positions[None], key_positions[None]))
