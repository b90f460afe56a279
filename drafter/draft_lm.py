"""Standalone small causal LM drafter (classic speculative sampling, or a tree
of its top-k proposals). It shares the target's tokenizer."""

from __future__ import annotations

import torch

from drafter.base import CachedTreeDrafter, DraftSession, read_value_temperature
from specdec.models import ModelSpec, load_causal_lm


class DraftLmDrafter(CachedTreeDrafter):
    name = "draft-lm"

    def __init__(self, spec: ModelSpec | None = None, max_sessions: int = 64, ttl_s: float = 600.0, model=None):
        self.model = model if model is not None else load_causal_lm(spec)
        self.body = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()
        super().__init__(vocab_size=int(self.model.config.vocab_size), max_sessions=max_sessions, ttl_s=ttl_s,
                         greedy_value_temperature=read_value_temperature(spec.path if spec is not None else None))

    def _new_cache(self):
        from specdec.kvcache import new_cache

        return new_cache(self.model.config)

    def _run(self, sess, tokens, positions, mask):
        dev = self.lm_head.weight.device
        mask = None if mask is None else mask.to(dev)
        out = self.body(input_ids=tokens[None].to(dev), position_ids=positions[None].to(dev), attention_mask=mask,
                        past_key_values=sess.cache, use_cache=True).last_hidden_state[0]
        return out, torch.log_softmax(self.lm_head(out).float(), dim=-1)

    def _feed_pending(self, sess: DraftSession):
        start, end = sess.fed, len(sess.tokens)
        tokens = torch.tensor(sess.tokens[start:end], dtype=torch.long)
        out, logp = self._run(sess, tokens, torch.arange(start, end), None)
        sess.fed = end
        return out[-1], logp[-1]

    def _step(self, sess, tokens, parent_hidden, positions, mask):
        return self._run(sess, tokens, positions, mask)
