"""Verifier engine: the target model, per-session KV caches, tree verification.

One verify step (DESIGN.md §3):
  1. forward the flattened tree on top of the session's cache with the
     ancestor mask and positions ``prefix_len + depth``;
  2. acceptance on the per-node target logits (greedy walk or recursive
     rejection sampling, ``specdec.tree.acceptance``);
  3. commit: keep prefix + root + accepted path in the cache, drop the rest.

The session's last committed token (the *root*) is always pending: its KV is
computed by the next verify, as node 0 of the next tree. Vanilla decoding is a
verify of a root-only tree, so baseline and speculative runs share every line
of model code. Lookahead decoding (``verify_lookahead``, ``verifier.lookahead``)
drafts the tree here, from the session's own n-gram pool, and verifies it
the same way.
"""

from __future__ import annotations

import threading

import torch

from specdec.compile.forwards import width_bucket
from specdec.model import kv
from specdec.request.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from specdec.request.knobs import check_tree_sizing
from specdec.request.lookahead import LookaheadParams
from specdec.request.params import SamplingParams
from specdec.serving.sessions import SessionTable
from specdec.tree.build import DraftTree
from specdec.tree.grammar import GrammarState
from specdec.tree.placed import DeviceTree
from specdec.tree.sampling import History, draw, make_generator, target_probs, token_logprobs
from specdec.tree.sizing import TreeSizer
from verifier.batch import verify_batch
from verifier.lookahead import lookahead_step
from verifier.prefix import TargetPrefixCache
from verifier.session import PrefillResult, TargetSession, VerifyResult
from verifier.target import TargetModel, check_tokens, check_tree

__all__ = ["PrefillResult", "TargetModel", "TargetSession", "VerifierEngine", "VerifyResult"]


class VerifierEngine:
    """Sessions of the target. With ``kv_budget_bytes`` set, a session is only
    admitted if its worst case (prompt + max_new_tokens + one full tree of
    ``max_tree_tokens``) fits next to every admitted session's worst case: a
    running session can never run the cache out of memory.

    ``prefix_cache_tokens`` (0: off): the committed K/V and features of prompt
    prefixes kept for later sessions' prefills, at most this many tokens
    (``verifier.prefix``); they count against ``kv_budget_bytes`` too, and go
    first when a session needs the room; ``prefix_cache_exact``: a hit gives
    the very bits of a miss (``specdec.model.prefix_cache``).

    ``tree_sizing``: "cost" gives the engine a ``TreeSizer`` (``sizer``)
    that whoever verifies through it (in-process generation, the gRPC
    service, before a tensor-parallel broadcast) applies to greedy sessions'
    trees; "fixed" (default): trees are verified as drafted.

    ``grammar_tokenizer``: llguidance's tokenizer of the target
    (``specdec.model.loading.default_grammar_tokenizer``), which constrained
    sessions' grammars need; None: constrained requests are refused.

    ``lookahead``: W, N, G of the sessions that verify by lookahead decoding
    (``verify_lookahead``; ``specdec.tree.lookahead``)."""

    def __init__(self, target: TargetModel, max_sessions: int = 64, ttl_s: float = 600.0,
                 kv_budget_bytes: int | None = None, max_tree_tokens: int = 64, tree_sizing: str = "fixed",
                 grammar_tokenizer=None, prefix_cache_tokens: int = 0, prefix_cache_exact: bool = False,
                 lookahead: LookaheadParams = LookaheadParams()):
        try:
            self.sizer = TreeSizer() if check_tree_sizing(tree_sizing) == "cost" else None
        except ValueError as exc:
            raise ValueError(f"tree_sizing {exc}") from None
        self.target = target
        self.grammar_tokenizer = grammar_tokenizer
        self.prefix = TargetPrefixCache(target, prefix_cache_tokens, prefix_cache_exact)
        self.sessions: SessionTable[TargetSession] = SessionTable(max_sessions, ttl_s)
        self.kv_budget_bytes = kv_budget_bytes
        self.max_tree_tokens = max_tree_tokens
        self.lookahead = lookahead
        self._admission = threading.Lock()

    def reserved_bytes(self) -> int:
        return sum(s.reserved_bytes for _, s in self.sessions.items())

    # -- session lifecycle ---------------------------------------------------
    def prefill(self, sid: str, prompt: list[int], params: SamplingParams,
                max_new_tokens: int = 0, resume: bool = False, logprobs: int | None = None,
                prompt_tokens: int = 0, feature_layers: tuple[int, ...] = (),
                prompt_logprobs: int | None = None, cache_salt: str = "") -> PrefillResult:
        """Run the prompt, pick the first token, open the session.

        ``resume``: ``prompt`` is a session's whole committed sequence, moved
        here from a lost verifier; its last token becomes the pending root
        again (nothing is sampled) and the features cover the others.
        ``logprobs``: return each committed token's raw logprob with this many
        top alternatives (None: none). ``prompt_tokens``: how many of
        ``prompt`` are the prompt, for the penalties that count generated
        tokens only (0: all; on resume, all but the pending root).
        ``feature_layers``: the session's features are the residual stream
        entering these target layers (HF hidden-state indices, concatenated: an
        EAGLE-3 drafter's), or the final hidden state when empty (EAGLE-1/2's).
        ``prompt_logprobs``: also return the raw logprob of every prompt token
        after the first, given the tokens before it, with this many top
        alternatives, from this forward's logits (None: none; not on resume;
        the prefix cache is then not looked up: every prompt token is scored).
        ``cache_salt``: the tenant's (and request's) salt: prefix-cache blocks
        are only shared between prefills of the same salt."""
        params.validate()
        feature_layers = self.target.check_feature_layers(feature_layers)
        check_tokens(self.target, prompt, "prompt")
        params.check_vocabulary(self.target.vocab_size, "sampling")
        if not prompt:
            raise InvalidArgument("prompt must not be empty")
        if params.constraint is not None and self.grammar_tokenizer is None:
            raise FailedPrecondition("sampling.constraint: this verifier has no tokenizer for structured output "
                                     "(start it with --tokenizer DIR, or a --target directory holding one)")
        if len(prompt) + max_new_tokens > self.target.max_positions:
            raise InvalidArgument(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"model's context of {self.target.max_positions} tokens")
        slots = len(prompt) + max(max_new_tokens, 1) + max(self.max_tree_tokens, self.lookahead.width)
        need = slots * self.target.kv_bytes_per_token
        with self._admission:          # reserve before computing, so concurrent prefills can't overshoot
            self.sessions.evict_idle()
            if self.kv_budget_bytes is not None:
                # sessions come first: cached prefixes make room before a session is refused
                over = self.reserved_bytes() + self.prefix.blocks.nbytes + need - self.kv_budget_bytes
                if over > 0:
                    self.prefix.blocks.evict_bytes(over)
                if self.reserved_bytes() + self.prefix.blocks.nbytes + need > self.kv_budget_bytes:
                    raise ResourceExhausted(
                        f"KV budget exhausted: this session needs up to {need} bytes, {self.reserved_bytes()} of "
                        f"{self.kv_budget_bytes} are reserved by {len(self.sessions)} sessions")
            generator = make_generator(params.seed, self.target.device)    # draws stay on the model's device
            sess = TargetSession(self.target.new_cache(slots), list(prompt), params, generator, reserved_bytes=need,
                                 logprobs=logprobs, feature_layers=feature_layers)
            sess.lock.acquire()        # nobody verifies on this session until its prefill is done
            self.sessions.add(sid, sess)
        first_logprobs = scored = drawn = None
        try:
            if resume:
                if len(prompt) < 2:
                    raise InvalidArgument("resuming a session needs at least two committed tokens")
                sess.tokens = sess.tokens[:-1]
                if params.penalized:
                    sess.history = History(self.target.vocab_size, sess.tokens, prompt_tokens or len(sess.tokens),
                                           self.target.device)
                sess.grammar = self._grammar(params, sess.tokens, prompt_tokens or len(sess.tokens))
                hidden, _ = self._run_prompt(sess.cache, prompt[:-1], feature_layers, cache_salt)
                first = prompt[-1]
            else:
                if params.penalized:
                    sess.history = History(self.target.vocab_size, sess.tokens, prompt_tokens or len(prompt),
                                           self.target.device)
                sess.grammar = self._grammar(params, sess.tokens, prompt_tokens or len(prompt))
                hidden, logits = self._run_prompt(sess.cache, prompt, feature_layers, cache_salt,
                                                  all_logits=prompt_logprobs is not None)
                counts = None if sess.history is None else sess.history.counts()
                allowed = None if sess.grammar is None else sess.grammar.mask()
                probs = target_probs(logits[-1], params, counts, allowed)
                drawn = probs.argmax().view(1) if params.greedy else draw(probs, generator)   # on the device
                first = int(drawn)
                if logprobs is not None:
                    first_logprobs = token_logprobs(logits[-1:], [first], logprobs)
                if prompt_logprobs is not None:     # position i predicts prompt token i + 1
                    scored = token_logprobs(logits[:-1], prompt[1:], prompt_logprobs)
        except BaseException:
            self.sessions.pop(sid)
            raise
        else:
            sess.commit([first])
            sess.root_device = None if resume else drawn        # the next step's root, there already
            self._fit_budget()
        finally:
            sess.lock.release()
        return PrefillResult(first, hidden, first_logprobs, scored)

    def _grammar(self, params: SamplingParams, tokens: list[int], prompt_len: int) -> GrammarState | None:
        """A constrained session's matcher, having consumed ``tokens[prompt_len:]``."""
        if params.constraint is None:
            return None
        return GrammarState(self.grammar_tokenizer, params.constraint, self.target.vocab_size, tokens, prompt_len)

    def _run_prompt(self, cache, tokens: list[int], feature_layers: tuple[int, ...], salt: str,
                    all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens`` into ``cache``: (features [n, F], logits [n, V], the last
        row at least: every row with ``all_logits``), through the prefix cache when on."""
        if self.prefix.on:
            return self.prefix.prefill(cache, tokens, feature_layers, salt, lookup=not all_logits,
                                       all_logits=all_logits)
        ids = torch.tensor(tokens, dtype=torch.long)
        return self.target.forward(cache, ids, torch.arange(len(tokens)), None, feature_layers,
                                   last_logits=not all_logits)

    def _fit_budget(self) -> None:
        """Cached prefixes within what the sessions' reservations leave of the KV budget."""
        if self.kv_budget_bytes is not None:
            over = self.reserved_bytes() + self.prefix.blocks.nbytes - self.kv_budget_bytes
            if over > 0:
                self.prefix.blocks.evict_bytes(over)

    def release(self, sid: str) -> bool:
        if self.sizer is not None:
            self.sizer.forget(sid)
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
    def verify(self, sid: str, tree: DraftTree | DeviceTree) -> VerifyResult:
        """``tree``'s verify; a tree drafted on the device and not read yet (an
        in-process drafter's, ``specdec.tree.placed.DeviceTree``) is verified
        as it is where it can be, and read with the verdict."""
        sess = self.sessions.get(sid)
        with sess.lock:
            if isinstance(tree, DeviceTree):
                result = self._verify_unread(sess, tree)
                if result is not None:
                    return result
                tree = tree.materialize()
            check_tree(self.target, sess, tree)
            prefix = sess.prefix_len
            hidden, logits, placed = self.target.forward_tree(sess.cache, tree, prefix, sess.feature_layers,
                                                              sess.root_device)
            return sess.settle(tree, prefix, hidden, logits, placed)

    def _verify_unread(self, sess: TargetSession, tree: DeviceTree) -> VerifyResult | None:
        """The verify of a tree still on the device, with no read before its
        verdict's (``TargetSession.settle_unread``); None: the tree is to be
        read first (a session or a forward this path does not serve, or the
        graph flagged its draft)."""
        placed, target = tree.placed, self.target
        device = torch.device(target.device)
        if (tree.root != sess.tokens[-1] or placed.prefix_len != sess.prefix_len or placed.n < 2
                or sess.grammar is not None or target.compiled is None
                or placed.width != width_bucket(placed.n) or placed.packed.device.type != device.type
                or device.index not in (None, placed.packed.device.index)
                or sess.prefix_len + tree.depth >= target.max_positions):
            return None
        target.fit(sess.cache, placed.n)
        if not target.compiled.tree_applies(sess.cache, placed.n, sess.feature_layers):
            return None
        hidden, logits = target.forward_placed(sess.cache, placed, sess.feature_layers)
        return sess.settle_unread(tree, hidden, logits)

    def verify_lookahead(self, sid: str, depth: int) -> VerifyResult:
        """A step of lookahead decoding (``verifier.lookahead``): the tree is
        the pool's guesses for the session's root, at most ``depth`` deep,
        verified in the forward that runs the window (``VerifyResult.nodes``: its size)."""
        if depth < 1:
            raise InvalidArgument(f"lookahead_depth must be >= 1, got {depth}")
        sess = self.sessions.get(sid)
        with sess.lock:
            return lookahead_step(self.target, sess, self.lookahead, depth)

    def verify_batch(self, items: list[tuple[str, DraftTree]]) -> list:
        """Several sessions' trees in one forward (``verifier.batch``)."""
        return verify_batch(self, items)

    def committed_tokens(self, sid: str) -> list[int]:
        return list(self.sessions.get(sid).tokens)

    def kv_bytes(self) -> int:
        """Bytes the open sessions' caches hold (the prefix cache's: ``prefix.blocks.nbytes``)."""
        return sum(kv.nbytes(s.cache) for _, s in self.sessions.items())
