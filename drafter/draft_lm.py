"""Standalone small causal LM drafter (classic speculative sampling, or a tree
of its top-k proposals). It shares the target's tokenizer; any causal LM
specdec can serve as a target can draft (``specdec.model.causal_lm``). With
``--compile`` its one-token steps, a commit's feed and its draft levels run
the target's compiled fixed-shape forward (``specdec.compile.forwards``) over the
same kind of cache, which moves up the capacity buckets as the session
fills; a prompt's feed runs eagerly."""

from __future__ import annotations

import torch

from specdec.compile.startup import compile_target
from specdec.model import prefix_cache as pc
from specdec.model.causal_lm import CausalLm
from specdec.model.loading import ModelSpec, load_causal_lm
from drafter.base import DraftSession, read_value_temperature
from drafter.cached import CachedTreeDrafter


class DraftLmDrafter(CachedTreeDrafter):
    name = "draft-lm"

    def __init__(self, spec: ModelSpec | None = None, max_sessions: int = 64, ttl_s: float = 600.0, model=None,
                 compile: str | None = None):
        """``compile``: ``--compile`` for the draft LM's steps (default: the spec's, else off)."""
        self.lm = CausalLm(model if model is not None else load_causal_lm(spec))
        mode = compile if compile is not None else (spec.compile if spec is not None else "off")
        self.compiled = compile_target(self.lm, mode)      # None: eager steps
        self.model, self.body = self.lm.model, self.lm.body
        super().__init__(vocab_size=int(self.model.config.get_text_config(decoder=True).vocab_size),
                         max_sessions=max_sessions, ttl_s=ttl_s,
                         greedy_value_temperature=read_value_temperature(spec.path if spec is not None else None))

    def new_cache(self):
        return self.lm.new_cache() if self.compiled is None else self.compiled.new_cache()

    @property
    def device(self) -> torch.device:
        return self.lm.device

    def logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Log-probs [..., V] of the model's outputs [..., H], its own final-logit processing included."""
        return torch.log_softmax(self.lm.logits(hidden), dim=-1)

    def _run(self, sess, tokens, positions, mask, resident: bool = False, last: bool = False):
        """(outputs [n, H], log-probs [n, V]: the last row's only, [1, V], with ``last``)."""
        done = None
        if self.compiled is not None:
            self.compiled.fit(sess.cache, len(tokens))
            out = self.compiled.run(sess.cache, tokens[None], positions[None], mask, resident=resident)
            done = None if out is None else (out[0], out[2])
        if done is not None:
            return done[0][0].to(self.lm.dtype), torch.log_softmax(done[1][0, -1:] if last else done[1][0], dim=-1)
        out = self.lm.hidden(sess.cache, tokens[None], positions[None], mask)[0]
        return out, self.logprobs(out[-1:] if last else out)

    def feed_pending(self, sess: DraftSession, end: int | None = None):
        start, end = sess.fed, len(sess.tokens) if end is None else end
        fresh = sess.fresh
        if (self.compiled is not None and fresh is not None and fresh[2] is not None and fresh[0] == start
                and fresh[2].shape[0] == end - start):
            # the last commit's tokens as the verifier left them on the device (in-process): its causal
            # mask and positions made there too, nothing copied up
            ids, n = fresh[2], end - start
            positions = torch.arange(start, end, device=ids.device)
            allowed = torch.ones(n, end, dtype=torch.bool, device=ids.device).tril(start)
            mask = self.lm.masks(allowed[None], positions[None], torch.arange(end, device=ids.device)[None],
                                 resident=True)
            out, logp = self._run(sess, ids, positions, mask, resident=True, last=True)
        else:
            tokens = torch.tensor(sess.tokens[start:end], dtype=torch.long)
            out, logp = self._run(sess, tokens, torch.arange(start, end), None, last=True)
        sess.fed = end
        return out[-1], logp[-1]

    def block_contents(self, sess: DraftSession, inputs: int):
        block = self.prefix.block             # input t is token t
        return (pc.token_bytes(sess.tokens[a:a + block]) for a in range(0, inputs - block + 1, block))

    def fit_cache(self, cache, n: int) -> None:
        if self.compiled is not None:
            self.compiled.fit(cache, n)

    def step(self, sess, tokens, parent_hidden, positions, allowed, key_positions):
        return self._run(sess, tokens, positions, self.lm.masks(allowed[None], positions[None], key_positions[None]))

    def level_step(self, sess, tokens, parent_hidden, positions, allowed, key_positions):
        """``step`` with every input on the device already (``specdec.tree.drawn``, ``ranked``)."""
        mask = self.lm.masks(allowed[None], positions[None], key_positions[None], resident=True)
        return self._run(sess, tokens, positions, mask, resident=True)
