"""The verifier's per-session state: ``TargetSession`` settles each verify of
a tree (acceptance, the KV cache kept, the tokens committed, their logprobs),
on the host or on the device (one read a cycle); ``VerifyResult`` and
``PrefillResult`` are what the engine answers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

import torch

from specdec.model import kv
from specdec.request.params import SamplingParams, TokenLogprob
from specdec.tree.acceptance import (Acceptance, ProposalTable, accept, greedy_walk, order_acceptance, proposal_table,
                                     sampled_order, walk_greedy)
from specdec.tree.build import DraftTree
from specdec.tree.grammar import GrammarState
from specdec.tree.lookahead import LookaheadState
from specdec.tree.placed import PARENTS, SEEN, TOKENS, DeviceTree, PlacedTree
from specdec.tree.sampling import History, TokenCounts, draw, greedy_tokens, target_probs, token_logprobs


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
        session asked for them: ``settle``'s path for a tree not placed on the
        device (eager forwards, trees wider than the compiled ones)."""
        self.logprobs_at = self.logprob_values = None          # (nothing read with a walk's verdict here)
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
        n, kept = placed.n, len(result.tokens)
        if not self.params.greedy:        # the accepted nodes' tokens, then the bonus (after the order and kept)
            bonus = verdict[n + 1:n + 2].long()
            return replace(result, token_ids=torch.cat([placed.row(TOKENS).index_select(0, order[1:kept]), bonus]))
        # the argmaxes along the path are the committed tokens (accepted ones, then the bonus)
        best = verdict if verdict.dtype == torch.long else verdict[:n].long()
        return replace(result, token_ids=best.index_select(0, order[:kept]))

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
