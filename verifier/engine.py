"""Verifier engine: the target model, per-session KV caches, tree verification.

One verify step (DESIGN.md §3):
  1. forward the flattened tree on top of the session's cache with the
     ancestor mask and positions ``prefix_len + depth``;
  2. acceptance on the per-node target logits (greedy walk or recursive
     rejection sampling, ``specdec.acceptance``);
  3. commit: keep prefix + root + accepted path in the cache, drop the rest.

The session's last committed token (the *root*) is always pending: its KV is
computed by the next verify, as node 0 of the next tree. Vanilla decoding is a
verify of a root-only tree, so baseline and speculative runs share every line
of model code.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from specdec import kv
from specdec.acceptance import Acceptance, accept
from specdec.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from specdec.models import ModelSpec, load_causal_lm
from specdec.params import SamplingParams, TokenLogprob
from specdec.sampling import History, make_generator, sample, target_probs, token_logprobs
from specdec.sessions import SessionTable
from specdec.tree import DraftTree


@dataclass
class TargetSession:
    cache: object                 # transformers DynamicCache: KV of `tokens[:-1]`
    tokens: list[int]             # committed tokens; the last one (root) is pending
    params: SamplingParams
    generator: torch.Generator
    reserved_bytes: int = 0       # worst-case KV this session may grow to (admission control)
    lock: threading.Lock = field(default_factory=threading.Lock)
    history: History | None = None  # penalty counts of `tokens` (only when a penalty is on)
    logprobs: int | None = None     # top alternatives per committed token's logprob; None: no logprobs

    @property
    def prefix_len(self) -> int:
        return len(self.tokens) - 1

    def decide(self, tree: DraftTree, logits: torch.Tensor) -> tuple[Acceptance, list[TokenLogprob] | None]:
        """Acceptance of ``tree`` on its target logits [n, V] (every node
        penalised with its own path's history), and the logprobs of the tokens
        it commits when the session asked for them. Plain decoding (root-only
        trees), the batched and the tensor-parallel verifiers all decide here."""
        counts = None if self.history is None else self.history.node_counts(tree.tokens, tree.ancestor_mask())
        result = accept(tree, logits, self.params, self.generator, counts)
        if self.logprobs is None:
            return result, None
        path = [0] + result.accepted
        return result, token_logprobs(logits[path], result.tokens(tree), self.logprobs)

    def commit(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        if self.history is not None:
            self.history.extend(tokens)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens (and the penalty counts of just those)."""
        del self.tokens[length:]
        if self.history is not None:
            self.history = History(self.history.vocab_size, self.tokens, self.history.prompt_len)


@dataclass(frozen=True)
class PrefillResult:
    token: int                    # first generated token (the first root)
    features: torch.Tensor        # [P, H] final hidden state at each prompt position
    logprobs: list[TokenLogprob] | None = None   # the first token's, when asked for (not on resume)


@dataclass(frozen=True)
class VerifyResult:
    accepted: list[int]           # accepted node indices, root excluded
    tokens: list[int]             # committed this cycle: accepted tokens + bonus
    features: torch.Tensor        # [len(accepted) + 1, H] at root + accepted nodes
    logprobs: list[TokenLogprob] | None = None   # one per committed token, when the session asked for them


class TargetModel:
    """A causal LM split into body (features) and lm_head (logits)."""

    def __init__(self, spec: ModelSpec, model=None):
        self.spec = spec
        self.model = model if model is not None else load_causal_lm(spec)
        self.body = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()
        self.config = self.model.config
        self.vocab_size = int(self.config.vocab_size)
        self.max_positions = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        self.device = next(self.model.parameters()).device

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every key/value head (all ranks together)."""
        c = self.config
        heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        elem = torch.finfo(next(self.model.parameters()).dtype).bits // 8
        return 2 * c.num_hidden_layers * heads * head_dim * elem

    def new_cache(self, capacity: int = 0):
        """A cache that grows in place (``specdec.kvcache``); ``capacity``: slots to allocate up front."""
        from specdec.kvcache import new_cache

        return new_cache(self.config, capacity)

    @torch.inference_mode()
    def forward(self, cache, tokens: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions: [n]; mask: [1, 1, n, prefix + n] or None (causal).
        Returns features [n, H] and fp32 logits [n, V]; appends n slots to cache."""
        out = self.body(input_ids=tokens[None].to(self.device), position_ids=positions[None].to(self.device),
                        attention_mask=None if mask is None else mask.to(self.device),
                        past_key_values=cache, use_cache=True)
        hidden = out.last_hidden_state[0]
        return hidden.float(), self.lm_head(hidden).float()


class VerifierEngine:
    """Sessions of the target. With ``kv_budget_bytes`` set, a session is only
    admitted if its worst case (prompt + max_new_tokens + one full tree of
    ``max_tree_tokens``) fits next to every admitted session's worst case: a
    running session can never run the cache out of memory."""

    def __init__(self, target: TargetModel, max_sessions: int = 64, ttl_s: float = 600.0,
                 kv_budget_bytes: int | None = None, max_tree_tokens: int = 64):
        self.target = target
        self.sessions: SessionTable[TargetSession] = SessionTable(max_sessions, ttl_s)
        self.kv_budget_bytes = kv_budget_bytes
        self.max_tree_tokens = max_tree_tokens
        self._admission = threading.Lock()

    def reserved_bytes(self) -> int:
        return sum(s.reserved_bytes for _, s in self.sessions.items())

    # -- session lifecycle ---------------------------------------------------
    def prefill(self, sid: str, prompt: list[int], params: SamplingParams,
                max_new_tokens: int = 0, resume: bool = False, logprobs: int | None = None,
                prompt_tokens: int = 0) -> PrefillResult:
        """Run the prompt, pick the first token, open the session.

        ``resume``: ``prompt`` is a session's whole committed sequence, moved
        here from a lost verifier; its last token becomes the pending root
        again (nothing is sampled) and the features cover the others.
        ``logprobs``: return each committed token's raw logprob with this many
        top alternatives (None: none). ``prompt_tokens``: how many of
        ``prompt`` are the prompt, for the penalties that count generated
        tokens only (0: all; on resume, all but the pending root)."""
        params.validate()
        self._check_tokens(prompt, "prompt")
        if not prompt:
            raise InvalidArgument("prompt must not be empty")
        if len(prompt) + max_new_tokens > self.target.max_positions:
            raise InvalidArgument(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"model's context of {self.target.max_positions} tokens")
        slots = len(prompt) + max(max_new_tokens, 1) + self.max_tree_tokens
        need = slots * self.target.kv_bytes_per_token
        with self._admission:          # reserve before computing, so concurrent prefills can't overshoot
            self.sessions.evict_idle()
            if self.kv_budget_bytes is not None and self.reserved_bytes() + need > self.kv_budget_bytes:
                raise ResourceExhausted(
                    f"KV budget exhausted: this session needs up to {need} bytes, {self.reserved_bytes()} of "
                    f"{self.kv_budget_bytes} are reserved by {len(self.sessions)} sessions")
            generator = make_generator(params.seed)
            sess = TargetSession(self.target.new_cache(slots), list(prompt), params, generator, reserved_bytes=need,
                                 logprobs=logprobs)
            sess.lock.acquire()        # nobody verifies on this session until its prefill is done
            self.sessions.add(sid, sess)
        first_logprobs = None
        try:
            if resume:
                if len(prompt) < 2:
                    raise InvalidArgument("resuming a session needs at least two committed tokens")
                sess.tokens = sess.tokens[:-1]
                if params.penalized:
                    sess.history = History(self.target.vocab_size, sess.tokens, prompt_tokens or len(sess.tokens))
                ids = torch.tensor(prompt[:-1], dtype=torch.long)
                hidden, _ = self.target.forward(sess.cache, ids, torch.arange(len(ids)), None)
                first = prompt[-1]
            else:
                ids = torch.tensor(prompt, dtype=torch.long)
                if params.penalized:
                    sess.history = History(self.target.vocab_size, sess.tokens, prompt_tokens or len(prompt))
                hidden, logits = self.target.forward(sess.cache, ids, torch.arange(len(prompt)), None)
                counts = None if sess.history is None else sess.history.counts()
                probs = target_probs(logits[-1], params, counts)
                first = int(probs.argmax()) if params.greedy else sample(probs, generator)
                if logprobs is not None:
                    first_logprobs = token_logprobs(logits[-1:], [first], logprobs)
        except BaseException:
            self.sessions.pop(sid)
            raise
        else:
            sess.commit([first])
        finally:
            sess.lock.release()
        return PrefillResult(first, hidden, first_logprobs)

    def release(self, sid: str) -> bool:
        return self.sessions.pop(sid) is not None

    def rollback(self, sid: str, length: int) -> None:
        """Keep the first ``length`` committed tokens (the last becomes the root)."""
        sess = self.sessions.get(sid)
        with sess.lock:
            if not 1 <= length <= len(sess.tokens):
                raise InvalidArgument(f"rollback length must be in [1, {len(sess.tokens)}], got {length}")
            kv.truncate(sess.cache, length - 1)
            sess.truncate(length)

    # -- the hot path ----------------------------------------------------------
    def verify(self, sid: str, tree: DraftTree) -> VerifyResult:
        sess = self.sessions.get(sid)
        with sess.lock:
            root = int(tree.tokens[0])
            if root != sess.tokens[-1]:
                raise FailedPrecondition(
                    f"tree root token {root} is not the session's last committed token {sess.tokens[-1]}")
            self._check_tokens(tree.tokens.tolist(), "tree token")
            prefix = sess.prefix_len
            n = tree.size
            deepest = prefix + int(tree.depths.max())
            if deepest >= self.target.max_positions:
                raise InvalidArgument(f"tree reaches position {deepest}, beyond the model's context of "
                                      f"{self.target.max_positions} tokens")
            mask = None if n == 1 else kv.tree_attention_mask(tree.ancestor_mask(), prefix)
            hidden, logits = self.target.forward(sess.cache, tree.tokens, tree.position_ids(prefix), mask)
            result, logprobs = sess.decide(tree, logits)
            path = [0] + result.accepted
            kv.commit_path(sess.cache, prefix, path)
            committed = result.tokens(tree)
            sess.commit(committed)
            return VerifyResult(result.accepted, committed, hidden[path], logprobs)

    def verify_batch(self, items: list[tuple[str, DraftTree]]) -> list:
        """Several sessions' trees in one forward (``verifier.batch``)."""
        from verifier.batch import verify_batch

        return verify_batch(self, items)

    def committed_tokens(self, sid: str) -> list[int]:
        return list(self.sessions.get(sid).tokens)

    def kv_bytes(self) -> int:
        return sum(kv.nbytes(s.cache) for _, s in self.sessions.items())

    def _check_tokens(self, tokens: list[int], what: str) -> None:
        bad = next((t for t in tokens if not 0 <= t < self.target.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(f"{what} id {bad} is outside the vocabulary [0, {self.target.vocab_size})")
