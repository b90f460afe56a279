"""The target model and the per-session state the verifier keeps for it.

``TargetModel`` splits a causal LM into its body (final hidden states, the
features drafters read) and its head (logits); ``check_tree`` holds the checks
a tree passes before any forward, shared by single and batched verification.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from specdec.compile.batched import compile_batches
from specdec.compile.eager import eager_run
from specdec.compile.forwards import CAPTURED, STARTUP_WIDTHS, WIDTHS, width_bucket
from specdec.compile.startup import compile_captures, compile_target
from specdec.model import kv
from specdec.model.causal_lm import CausalLm
from specdec.model.loading import ModelSpec, load_causal_lm
from specdec.model.masks import tree_allowed
from specdec.request.errors import FailedPrecondition, InvalidArgument
from specdec.request.params import SamplingParams, TokenLogprob
from specdec.tree.acceptance import (Acceptance, ProposalTable, accept, greedy_walk, order_acceptance, proposal_table,
                                     sampled_order, walk_greedy)
from specdec.tree.build import DraftTree
from specdec.tree.grammar import GrammarState
from specdec.tree.lookahead import LookaheadState
from specdec.tree.placed import PARENTS, SEEN, TOKENS, DeviceTree, PlacedTree, place_root, place_tree
from specdec.tree.sampling import History, TokenCounts, draw, greedy_tokens, target_probs, token_logprobs

log = logging.getLogger(__name__)


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
    feature_layers: tuple[int, ...] = ()   # what its features are (``TargetModel.run``)
    grammar: GrammarState | None = None    # a constrained session's matcher at the committed tokens
    lookahead: LookaheadState | None = None  # its pool and window, once it verified by lookahead decoding
    root_device: torch.Tensor | None = None  # the pending root's token [1] on the device, where the last step drew it
    # a walk's logprobs, made on the device with its verdict (``walk``): where they start in the read, and
    # what the read gave of them (``committed_logprobs``)
    logprobs_at: int | None = field(default=None, repr=False)
    logprob_values: list | None = field(default=None, repr=False)

    @property
    def prefix_len(self) -> int:
        return len(self.tokens) - 1

    def processors(self, tree: DraftTree | DeviceTree, placed: PlacedTree | None = None
                   ) -> tuple[TokenCounts | None, torch.Tensor | None]:
        """Every node's penalty counts (its own path's history) and grammar mask
        (along its own path), where the session has them; the counts from the
        tree ``placed`` on the device where it is (no host data)."""
        if self.history is None:
            counts = None
        elif placed is not None:
            counts = self.history.placed_counts(placed.row(SEEN), placed.row(TOKENS))
        else:
            counts = self.history.node_counts(tree.tokens, tree.ancestor_mask())
        allowed = None if self.grammar is None else self.grammar.node_masks(tree.token_list, tree.parent_list)
        return counts, allowed

    def decide(self, tree: DraftTree, logits: torch.Tensor) -> tuple[Acceptance, list[TokenLogprob] | None]:
        """Acceptance of ``tree`` on its target logits [n, V] (every node
        penalised with its own path's history and masked by the grammar along
        its own path), and the logprobs of the tokens it commits when the
        session asked for them. Plain decoding (root-only trees), the batched
        and the tensor-parallel verifiers all decide here."""
        result = accept(tree, logits, self.params, self.generator, *self.processors(tree))
        return result, self.committed_logprobs(tree, result, logits)

    def committed_logprobs(self, tree: DraftTree, result: Acceptance, logits: torch.Tensor
                           ) -> list[TokenLogprob] | None:
        if self.logprobs is None:
            return None
        path = [0] + result.accepted
        tokens = result.tokens(tree)
        values, self.logprob_values = self.logprob_values, None
        if values is None:
            return token_logprobs(logits[path], tokens, self.logprobs)
        n, k = logits.shape[0], self.logprobs          # read with the verdict (``logprob_parts``)
        edge, bonus, top_values, top_ids = values[:n], values[n], values[n + 1:n + 1 + n * k], values[n + 1 + n * k:]
        return [TokenLogprob(t, edge[result.accepted[j]] if j < len(result.accepted) else bonus,
                             tuple(int(i) for i in top_ids[u * k:(u + 1) * k]), tuple(top_values[u * k:(u + 1) * k]))
                for j, (t, u) in enumerate(zip(tokens, path))]

    def logprob_parts(self, logits: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor,
                      last: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
        """What ``committed_logprobs`` needs of a walk, made on the device to be
        read with its verdict, whatever the path (fp64): every node's token's
        logprob at its parent [n], the bonus token's at the last node [1], and
        every node's ``logprobs`` best alternatives (logprobs, then ids [n k]):
        ``token_logprobs``' values (log-softmax of the fp32 logits)."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        k = min(self.logprobs, logp.shape[-1])
        top_values, top_ids = logp.topk(k, dim=-1)
        return torch.cat([logp[parents, tokens].double(), logp[last, bonus].double(),
                          top_values.flatten().double(), top_ids.flatten().double()])

    def with_logprobs(self, verdict: torch.Tensor, logits: torch.Tensor, parents: torch.Tensor,
                      tokens: torch.Tensor, last: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
        """``verdict`` with the walk's logprob parts after it where the session
        asked for logprobs (``acceptance`` splits them off): one read for both."""
        if self.logprobs is None:
            return verdict
        self.logprobs_at = verdict.shape[0]
        return torch.cat([verdict.double(), self.logprob_parts(logits, parents, tokens, last, bonus)])

    def settle(self, tree: DraftTree, prefix: int, hidden: torch.Tensor, logits: torch.Tensor,
               placed: PlacedTree | None = None) -> VerifyResult:
        """After ``tree``'s forward at ``prefix`` (its nodes' features [n, F] and
        logits [n, V], the first n slots appended): acceptance, then the cache
        keeps the prefix, the root and the accepted path (anything after the
        tree's slots goes too) and the session commits the tokens. With the
        tree ``placed`` on the device, the walk runs there too (greedy:
        ``greedy_order``; sampled: ``sampled_order``, drawn proposals too),
        and the cache's compaction and the features' gather follow it there:
        the argmaxes, or the path and the bonus, are the one read."""
        if placed is not None and tree.size == 1 and self.grammar is None:
            return self.step_root(tree, prefix, hidden, logits)
        if placed is not None and tree.size > 1:
            counts, allowed = self.processors(tree, placed)
            drawn = not self.params.greedy and getattr(tree, "proposals", None)
            table = proposal_table(tree, logits.device) if drawn else None
            order, verdict, ends = self.walk(placed, logits, counts, allowed, table)
            kv.reorder_tail(self.cache, prefix, order)
            result = self.acceptance(tree, verdict.tolist())                       # the read
            return self.keep(tree, prefix, result, hidden, logits, (counts, *ends) if ends else None, order)
        result, logprobs = self.decide(tree, logits)
        path = [0] + result.accepted
        kv.keep_path(self.cache, prefix, path)
        # a copy of the kept rows: the drafter may hold them for the whole session
        features = hidden[:len(path)].clone() if path == list(range(len(path))) else hidden[path]
        committed = result.tokens(tree)
        self.commit(committed)
        return VerifyResult(result.accepted, committed, features, logprobs)

    def step_root(self, tree: DraftTree, prefix: int, hidden: torch.Tensor, logits: torch.Tensor) -> VerifyResult:
        """``settle`` of a root-only tree on the compiled path (plain decoding's
        step): the token is drawn (greedy: the argmax) as ``accept`` draws it,
        read once, and kept on the device for the next step's forward
        (``root_device``), the penalty counts committed there too."""
        counts, allowed = self.processors(tree)
        if self.params.greedy:
            token = greedy_tokens(logits, self.params, counts, allowed)                # [1] on the device
        else:
            token = draw(target_probs(logits, self.params, counts, allowed)[0], self.generator)
        if self.logprobs is None:
            result = Acceptance(accepted=[], bonus=int(token))                         # the read
        else:                                                                           # the read, logprobs too
            root = torch.zeros_like(token)
            values = self.with_logprobs(token, logits, root, root, root, token).tolist()
            self.logprobs_at, self.logprob_values = None, values[1:]
            result = Acceptance(accepted=[], bonus=int(values[0]))
        counted = None if counts is None else (counts, torch.zeros_like(token), token)
        verified = self.keep(tree, prefix, result, hidden, logits, counted)
        self.root_device = token
        return verified

    def settle_unread(self, tree: DeviceTree, hidden: torch.Tensor, logits: torch.Tensor) -> VerifyResult | None:
        """``settle`` of a tree drafted on the device and verified before anyone
        read it (its one-hot proposals, greedy or sampled, penalties counted on
        the device, no grammar: ``VerifierEngine.verify``): the draft is read
        with the verdict, the cycle's one read. None where the graph flagged
        its draft: nothing is kept (the cache back at the prefix, the
        generator's draws undone, the counts as they were), and the tree's
        level-by-level draft is the one to verify."""
        prefix, placed = self.prefix_len, tree.placed
        state = None if self.params.greedy else self.generator.get_state()
        counts = self.processors(tree, placed)[0]
        order, verdict, ends = self.walk(placed, logits, counts, None, None if self.params.greedy else tree.table)
        kv.reorder_tail(self.cache, prefix, order)
        values = torch.cat([tree.read, verdict]).tolist()        # the one read: the draft and its verdict
        split = tree.read.shape[0]
        drafted = tree.resolve(values[:split])
        if drafted is None:
            self.logprobs_at = None
            kv.truncate(self.cache, prefix)
            if state is not None:
                self.generator.set_state(state)
            return None
        result = self.keep(drafted, prefix, self.acceptance(drafted, values[split:]), hidden, logits,
                           (counts, *ends) if ends else None, order)
        if not self.params.greedy:
            return result
        # the argmaxes along the path are the committed tokens (accepted ones, then the bonus)
        best = verdict if verdict.dtype == torch.long else verdict[:placed.n].long()
        return replace(result, token_ids=best.index_select(0, order[:len(result.tokens)]))

    def walk(self, placed: PlacedTree, logits: torch.Tensor, counts: TokenCounts | None,
             allowed: torch.Tensor | None, table: ProposalTable | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
        """Acceptance on the device (greedy: ``greedy_walk``; sampled:
        ``sampled_order``, over the drawn proposals in ``table`` where the tree
        has them, else one-hot ones): the nodes in order [n], the root
        and the accepted ones first; what the host reads of the verdict (the
        argmaxes, or the order and its tail); and, with ``counts`` (the
        session's penalties, per node), the path's last node and the bonus
        token ([1] each) that ``History.advance`` commits (else None)."""
        wanted = counts is not None or self.logprobs is not None
        if self.params.greedy:
            best = greedy_tokens(logits, self.params, counts, allowed)              # [n] on the device
            order, on_path = greedy_walk(placed, best)
            if not wanted:
                return order, best, None
            last = order.gather(0, on_path.sum().view(1) - 1)
            ends, verdict = (last, best.gather(0, last)), best
        else:
            probs = target_probs(logits, self.params, counts, allowed)
            order, tail = sampled_order(placed, probs, self.generator, table)
            verdict = torch.cat([order, tail])
            if not wanted:
                return order, verdict, None
            ends = (order.gather(0, tail[:1] - 1), tail[1:])
        verdict = self.with_logprobs(verdict, logits, placed.row(PARENTS), placed.row(TOKENS), *ends)
        return order, verdict, ends if counts is not None else None

    def walk_placed(self, tree: DraftTree, placed: PlacedTree, logits: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
        """``walk`` of ``tree`` placed on the device, its verdict unread
        (``acceptance`` takes it read), for a verify that reads several
        sessions' verdicts at once (``verifier.batch``): a root-only tree draws
        as ``step_root`` does; -> (order [n], verdict, the counts ``keep``
        commits or None)."""
        counts, allowed = self.processors(tree, placed)
        if tree.size == 1:
            if self.params.greedy:
                token = greedy_tokens(logits, self.params, counts, allowed)                    # [1]
                verdict = token
            else:
                token = draw(target_probs(logits, self.params, counts, allowed)[0], self.generator)
                verdict = torch.cat([torch.zeros_like(token), torch.ones_like(token), token])   # order, kept, bonus
            root = torch.zeros_like(token)
            verdict = self.with_logprobs(verdict, logits, root, root, root, token)
            return root, verdict, None if counts is None else (counts, root, token)
        drawn = not self.params.greedy and getattr(tree, "proposals", None)
        table = proposal_table(tree, logits.device) if drawn else None
        order, verdict, ends = self.walk(placed, logits, counts, allowed, table)
        return order, verdict, (counts, *ends) if ends else None

    def acceptance(self, tree: DraftTree, verdict: list) -> Acceptance:
        """The acceptance out of ``walk``'s verdict, read (the logprobs read with
        it kept for ``committed_logprobs``)."""
        if self.logprobs_at is not None:
            verdict, self.logprob_values = verdict[:self.logprobs_at], verdict[self.logprobs_at:]
            self.logprobs_at = None
        if self.params.greedy:
            return walk_greedy(tree, [int(v) for v in verdict])
        return order_acceptance(verdict)

    def keep(self, tree: DraftTree, prefix: int, result: Acceptance, hidden: torch.Tensor,
             logits: torch.Tensor, counted: tuple | None = None, order: torch.Tensor | None = None
             ) -> VerifyResult:
        """After a walk on the device (the cache's tail in ``order``, the walk's
        nodes, the kept ones first; None: a root-only tree): the root and the
        accepted path kept, the tokens committed, their features gathered out of
        ``hidden`` [n, F] in one operator (just those rows: a drafter may hold
        them for the whole session); ``counted``: the walk's (counts, last,
        bonus), which commit the penalty counts on the device."""
        kept = len(result.accepted) + 1
        kv.truncate(self.cache, prefix + kept)
        features = hidden[:kept] if order is None else hidden.index_select(0, order[:kept])
        logprobs = self.committed_logprobs(tree, result, logits)
        committed = result.tokens(tree)
        if counted is not None:
            self.history.advance(*counted)
        self.commit(committed, counted=counted is not None)
        return VerifyResult(result.accepted, committed, features, logprobs)

    def commit(self, tokens: list[int], counted: bool = False) -> None:
        """``tokens`` committed (``counted``: the penalty counts have them already)."""
        self.root_device = None
        self.tokens.extend(tokens)
        if self.history is not None and not counted:
            self.history.extend(tokens)
        if self.grammar is not None:
            self.grammar.commit(tokens)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens (and the penalty counts of just those)."""
        self.root_device = None
        del self.tokens[length:]
        if self.history is not None:
            self.history = History(self.history.vocab_size, self.tokens, self.history.prompt_len,
                                   self.history.device)
        if self.grammar is not None:
            self.grammar.truncate(length)


@dataclass(frozen=True)
class PrefillResult:
    token: int                    # first generated token (the first root)
    features: torch.Tensor        # [P, F] the session's features at each prompt position (``TargetModel.run``)
    logprobs: list[TokenLogprob] | None = None   # the first token's, when asked for (not on resume)
    prompt_logprobs: list[TokenLogprob] | None = None   # prompt[1:]'s, when asked for (not on resume)


@dataclass(frozen=True)
class VerifyResult:
    accepted: list[int]           # accepted node indices, root excluded
    tokens: list[int]             # committed this cycle: accepted tokens + bonus
    features: torch.Tensor        # [len(accepted) + 1, F] at root + accepted nodes
    logprobs: list[TokenLogprob] | None = None   # one per committed token, when the session asked for them
    nodes: int = 0                # nodes of the tree the verifier drafted itself (lookahead); 0: the tree sent
    token_ids: torch.Tensor | None = None   # ``tokens`` on the device (a greedy walk there): an in-process
                                            # drafter feeds them without a host copy


class TargetModel:
    """A causal LM split into body (features) and head (logits, with the model's
    own final-logit processing): ``specdec.model.causal_lm``."""

    def __init__(self, spec: ModelSpec, model=None):
        self.spec = spec
        self.lm = CausalLm(model if model is not None else load_causal_lm(spec))
        self.model, self.config = self.lm.model, self.lm.config
        self.vocab_size = int(self.config.get_text_config(decoder=True).vocab_size)
        self.max_positions = int(getattr(self.config.get_text_config(decoder=True), "max_position_embeddings",
                                         None) or 1 << 30)
        self.num_layers = int(self.config.get_text_config(decoder=True).num_hidden_layers)
        self.device = self.lm.device
        self.kv_bytes_per_token = self._measure_kv_bytes()
        self.compiled = compile_target(self.lm, spec.compile, spec.compile_layers)     # None: eager forwards
        self._told_eager_layers = False

    def _measure_kv_bytes(self) -> int:
        """K and V bytes per token, every layer, every key/value head, all ranks
        together: measured on a one-token cache, whatever the model's head layout."""
        cache = self.lm.new_cache(1)
        with torch.inference_mode():
            self.lm.hidden(cache, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), None)
        ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return kv.nbytes(cache) * ranks

    def new_cache(self, capacity: int = 0):
        """A cache that grows in place (``specdec.model.kv``); ``capacity``: slots to allocate up front
        (with compiled forwards: the smallest capacity bucket, moved up as
        the session fills, ``specdec.compile.forwards``)."""
        return self.lm.new_cache(capacity) if self.compiled is None else self.compiled.new_cache()

    def compile_feature_layers(self) -> bool:
        """With compiled forwards, add those returning feature layers (EAGLE-3
        sessions', ``specdec.compile.startup.compile_captures``) if not built yet:
        what an in-process EAGLE-3 drafter asks of its target. Whether they are on."""
        return self.compiled is not None and compile_captures(self.compiled)

    def compile_trees(self, total_tokens: int, open_now: bool = True) -> None:
        """With compiled forwards, the graphs of trees of up to ``total_tokens``
        nodes past the start-up widths (``STARTUP_WIDTHS`` follow the default
        tree) built now where missing and opened before any request (``open_now``;
        else left for a server to open while idle), so that no request builds
        one (minutes for a cold package). A no-op otherwise."""
        wanted = width_bucket(total_tokens) or WIDTHS[-1]
        widths = tuple(w for w in WIDTHS if max(STARTUP_WIDTHS) < w <= wanted)
        if self.compiled is None or not widths:
            return
        self.compiled.warm(widths, ready=())
        if self.compiled.capturing is not None:
            self.compiled.warm(widths, captures=True, ready=())
        if open_now:
            self.compiled.open_all()

    def unbuilt_eager(self, total_tokens: int) -> None:
        """A server's compiled forwards: the graphs of trees of up to
        ``total_tokens`` nodes built now where missing (opened while idle), and
        none ever built on a request: a wider tree's width, whose package is
        not on disk, verifies eagerly (one log line per width) instead of
        holding its request for the build. A no-op without compiled forwards."""
        if self.compiled is not None:
            self.compile_trees(total_tokens, open_now=False)
            self.compiled.build_on_use = False

    def compile_batches(self) -> bool:
        """With compiled forwards, add the batched ones (a verifier that batches:
        ``specdec.compile.batched``). Whether they are on."""
        return self.compiled is not None and compile_batches(self.compiled)

    def batch_cache(self, caches: list, lengths: list[int], n: int, layers: tuple[int, ...] = ()):
        """A cache for one batched forward of ``n`` tokens a row over ``caches``:
        row b holds ``caches[b]``'s first ``lengths[b]`` slots, zeros up to
        the longest, room for the ``n`` tokens after that; a compiled-path one
        where a batched graph serves it (``CompiledForward.batch_cache``)."""
        batch = None if self.compiled is None else self.compiled.batch_cache(caches, lengths, n, layers)
        if batch is None:
            batch = self.lm.new_cache()
            kv.gather_rows(batch, caches, lengths, max(lengths), n)
        return batch

    def append_row(self, cache, batch, row: int, slots: torch.Tensor) -> None:
        """Append row ``row``'s ``slots`` [m] of a ``batch_cache`` to a session's cache."""
        if self.compiled is None or not self.compiled.append_row(cache, batch, row, slots):
            self.fit(cache, slots.numel())
            kv.append_slots(cache, batch, row, slots)

    def reuse(self, batch) -> None:
        """A ``batch_cache`` no longer used: its buffer serves the next batch of its shape (compiled ones)."""
        if self.compiled is not None:
            self.compiled.reuse(batch)

    def batches_row_by_row(self, caches: list, lengths: list[int], n: int, layers: tuple[int, ...] = ()) -> bool:
        """Whether a batch runs best one row at a time: every row's own forward is
        compiled, but no batched graph serves the batch (one eager batched
        forward is slower than the compiled rows; ``specdec.compile.batched``)."""
        return (self.compiled is not None and not self.compiled.serves_batch(lengths, n, layers)
                and all(self.compiled.takes(cache, n, layers) for cache in caches))

    def fit(self, cache, n: int) -> None:
        """Before ``n`` slots are written to ``cache``: with compiled forwards,
        a session's buffer moved up to the capacity bucket that holds them
        (``CompiledForward.fit``), so it stays on the compiled path."""
        if self.compiled is not None:
            self.compiled.fit(cache, n)

    def masks(self, allowed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, resident: bool = False):
        """The attention mask for allowed [B, q, k], query positions [B, q], key positions [B, k]
        (``resident``: made on the device, where they are)."""
        return self.lm.masks(allowed, q_pos, k_pos, resident=resident)

    def forward_tree(self, cache, tree: DraftTree, prefix_len: int, layers: tuple[int, ...] = (),
                     root: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, PlacedTree | None]:
        """``forward`` of ``tree`` after the ``prefix_len`` slots of ``cache``:
        features [n, F], logits [n, V], and the tree placed on the device
        where the compiled path runs it (``specdec.tree.placed``: its one
        upload, the mask built there; a root-only tree whose token is on the
        device already, ``root``, none; None: the forward took the host's
        tokens, positions and mask)."""
        self.fit(cache, tree.size)
        if self.compiled is not None and self.compiled.tree_applies(cache, tree.size, layers):
            width = width_bucket(tree.size)
            placed = place_root(root, prefix_len, width) if root is not None and tree.size == 1 else \
                place_tree(tree, prefix_len, width, self.device)
            return (*self.forward_placed(cache, placed, layers), placed)
        mask = None if tree.size == 1 else self.tree_masks(tree, prefix_len)
        hidden, logits = self.forward(cache, tree.tokens, tree.position_ids(prefix_len), mask, layers)
        return hidden, logits, None

    def forward_placed(self, cache, placed: PlacedTree, layers: tuple[int, ...] = ()
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The compiled forward of a tree placed on the device (``tree_applies``
        once ``fit``): features [n, F], logits [n, V]."""
        final, captured, logits = self.compiled.run_placed(cache, placed, layers)
        return select_features(final, captured, layers, layers)[0], logits[0]

    def tree_masks(self, tree: DraftTree, prefix_len: int):
        """The attention mask for one tree over a prefix of ``prefix_len`` slots."""
        positions = tree.position_ids(prefix_len)
        k_pos = torch.cat([torch.arange(prefix_len), positions])
        return self.masks(tree_allowed(tree.ancestor_mask(), prefix_len)[None], positions[None], k_pos[None])

    @torch.inference_mode()
    def forward(self, cache, tokens: torch.Tensor, positions: torch.Tensor, mask,
                layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions: [n]; mask from ``tree_masks`` or None (causal).
        Returns features [n, F] (``run``) and fp32 logits [n, V]; appends n slots to cache."""
        hidden, logits = self.forward_batch(cache, tokens[None], positions[None], mask, layers)
        return hidden[0], logits[0]

    @torch.inference_mode()
    def forward_batch(self, cache, tokens: torch.Tensor, positions: torch.Tensor, mask,
                      layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions: [B, n] -> features [B, n, F], fp32 logits [B, n, V]."""
        final, captured, logits = self.run(cache, tokens, positions, mask, layers)
        return select_features(final, captured, layers, layers), logits

    @torch.inference_mode()
    def run(self, cache, tokens: torch.Tensor, positions: torch.Tensor, mask,
            layers: tuple[int, ...] = (), resident: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """One forward: the final hidden state [B, n, H] (fp32: EAGLE-1/2's
        feature), the residual stream entering each of ``layers`` (HF
        ``output_hidden_states`` indices: EAGLE-3's features) concatenated
        [B, n, len(layers) H] or None when ``layers`` is empty, fp32 logits [B, n, V].
        The compiled forward runs where it applies (``specdec.compile.forwards``;
        with layers, where its capturing graphs were built); ``resident``:
        tokens, positions and mask are on the device already."""
        self.fit(cache, tokens.shape[1])
        out = None if self.compiled is None else self.compiled.run(cache, tokens, positions, mask, layers, resident)
        if out is not None:
            return out
        if layers and self.compiled is not None and not self.compiled.captures(layers) and not self._told_eager_layers:
            self._told_eager_layers = True
            why = ("start the verifier with --compile-feature-layers to compile their forwards too"
                   if self.compiled.capturing is None else f"compiled forwards return at most {CAPTURED}")
            log.warning("sessions asking for %d feature layers verify eagerly: %s", len(layers), why)
        return eager_run(self.lm, cache, tokens, positions, mask, layers)

    def check_feature_layers(self, layers) -> tuple[int, ...]:
        layers = tuple(int(i) for i in layers)
        if len(layers) > MAX_FEATURE_LAYERS or not all(0 <= i < self.num_layers for i in layers):
            raise InvalidArgument(f"feature_layers must be at most {MAX_FEATURE_LAYERS} HF hidden-state indices "
                                  f"in [0, {self.num_layers}), got {list(layers)}")
        return layers


MAX_FEATURE_LAYERS = 8


def select_features(final: torch.Tensor, captured: torch.Tensor | None, captured_layers: tuple[int, ...],
                    layers: tuple[int, ...]) -> torch.Tensor:
    """A session's features out of one ``TargetModel.run``: ``final`` [..., H]
    when it asked for no layers, else the chunks of ``captured`` (the layers
    ``captured_layers``, H wide each) for its ``layers``, in its order."""
    if not layers:
        return final
    if tuple(layers) == tuple(captured_layers):
        return captured
    width = final.shape[-1]
    return torch.cat([captured[..., captured_layers.index(i) * width:(captured_layers.index(i) + 1) * width]
                      for i in layers], dim=-1)


def check_tokens(target: TargetModel, tokens: list[int], what: str) -> None:
    bad = next((t for t in tokens if not 0 <= t < target.vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"{what} id {bad} is outside the vocabulary [0, {target.vocab_size})")


def check_tree(target: TargetModel, sess: TargetSession, tree: DraftTree) -> None:
    """A tree rooted at the session's pending token, inside the vocabulary and the context."""
    root = tree.token_list[0]
    if root != sess.tokens[-1]:
        raise FailedPrecondition(
            f"tree root token {root} is not the session's last committed token {sess.tokens[-1]}")
    check_tokens(target, tree.token_list, "tree token")
    deepest = sess.prefix_len + max(tree.depth_list)
    if deepest >= target.max_positions:
        raise InvalidArgument(f"tree reaches position {deepest}, beyond the model's context of "
                              f"{target.max_positions} tokens")
