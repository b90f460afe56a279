"""Grammar masks along a draft tree: a constraint as part of the processed distribution.

A constrained session (``specdec.request.constraints``) may generate only the
tokens its grammar allows. Exactness under speculation asks that the
distribution at every tree node be the one constrained decoding would use
after that node's path, so each node gets the mask of **its own path**:

- the session's ``GrammarState`` holds an llguidance matcher at the committed
  state: it has consumed the generated tokens, root included (the prompt is
  not part of the grammar's sentence), and moves by committed tokens only;
- ``node_masks`` walks the tree depth first from the root: at node u it
  computes the mask of allowed next tokens, and for each child whose token the
  mask allows it consumes that token, recurses, and rolls the matcher back by
  one; the matcher ends where it started;
- a child whose token the grammar refuses has probability zero at its parent
  under the target, so it is never accepted; its own row (and its subtree's)
  is left unmasked (any row would do; an all-refused one would make NaNs). So
  are the rows below an end-of-sequence token or a complete grammar (where
  generation stops) and a row where the grammar allows nothing at all.

``mask_logits`` sets refused tokens' logits to -inf: the first of the target's
processors (``specdec.tree.sampling``), before the logit bias, the penalties,
temperature and the filters, as vLLM applies the grammar bitmask. Greedy
decoding takes the argmax of the masked logits; the end-of-sequence token is
allowed only where the grammar accepts, and where the grammar is complete it
is the only token allowed, so generation stops there.

Drafters mask their proposals the same way (``masked_expand``): a drafted
token the grammar refuses could never be accepted, so the draft keeps its
budget for tokens that can; sampled proposals are drawn from the draft
distribution renormalised over the allowed tokens, which stays exact since
acceptance uses the distribution the children were drawn from.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from specdec.request.constraints import Constraint, parser_limits
from specdec.request.errors import FailedPrecondition, InvalidArgument


@dataclass
class GrammarTime:
    """Time this process spent on per-node grammar masks (the verifier's tree
    walks and the drafters' masked levels), read by ``specdec bench --json-schema``."""

    seconds: float = 0.0
    masks: int = 0             # node masks computed


GRAMMAR_TIME = GrammarTime()


class GrammarState:
    """A session's matcher at its committed state, and the masks of a tree's nodes.

    ``vocab_size``: the model's vocabulary (masks are [.., vocab_size]; ids past
    the tokenizer's are refused). ``tokens``: the committed sequence so far,
    whose first ``prompt_len`` are the prompt."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, constraint: Constraint, vocab_size: int,
                 tokens: list[int] = (), prompt_len: int = 0):
        self.tokenizer, self.constraint, self.vocab_size = tokenizer, constraint, vocab_size
        self.matcher = llguidance.LLMatcher(tokenizer, constraint.grammar(), log_level=0, limits=parser_limits())
        if self.matcher.is_error():
            raise InvalidArgument(f"sampling.constraint.value does not compile: {self.matcher.get_error()[:300]}")
        self.prompt_len = prompt_len
        self.consumed = 0
        # end-of-sequence ids: never consumed while walking a tree (generation ends there,
        # and a matcher does not roll one back reliably)
        self.eos = frozenset(getattr(tokenizer, "eos_tokens", None) or [tokenizer.eos_token])
        self.words = (tokenizer.vocab_size + 31) // 32      # bitmask width
        self.commit(list(tokens)[prompt_len:])

    def commit(self, tokens: list[int]) -> None:
        """Generated tokens, committed (each one the grammar allowed). Tokens past
        the grammar's end (after its end-of-sequence token, where generation
        stops anyway) are not consumed."""
        tokens = [int(t) for t in tokens]
        taken = self.matcher.try_consume_tokens(tokens) if tokens else 0
        self.consumed += taken
        if taken < len(tokens) and self.matcher.is_error():
            raise InvalidArgument(f"sampling.constraint is too costly to follow (the grammar engine's limit): "
                                  f"{self.matcher.get_error()[:200]}")
        if taken < len(tokens) and not self.matcher.is_stopped():
            raise FailedPrecondition(f"the committed token {tokens[taken]} breaks the session's grammar")

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` committed tokens (prompt included)."""
        drop = self.consumed - max(0, length - self.prompt_len)
        if drop > 0:
            self.matcher.rollback(drop)
            self.consumed -= drop

    def mask(self) -> torch.Tensor:
        """[vocab_size] bool: the tokens allowed next at the matcher's state.
        InvalidArgument when the grammar engine gave up (a limit of
        ``parser_limits`` reached: a constraint too costly to follow)."""
        bits = np.zeros((1, self.words), dtype=np.int32)
        self._fill(bits, 0)
        self._check()
        return bitmask_rows(bits, self.vocab_size)[0]

    def node_masks(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """[n, vocab_size] bool: row u allows the tokens the grammar allows after
        the root-to-u path (see the module docstring)."""
        start = time.perf_counter()
        n = len(tokens)
        bits = np.zeros((n, self.words), dtype=np.int32)    # llguidance's bitmasks, 32 tokens a word
        children: list[list[int]] = [[] for _ in range(n)]
        for node in range(1, n):
            children[parents[node]].append(node)

        def visit(node: int) -> None:      # depth first: consume a child's token, recurse, roll back
            self._fill(bits, node)
            for child in children[node]:
                # refused (or after the grammar's end): never consumed, its row stays empty
                if tokens[child] not in self.eos and self.matcher.try_consume_tokens([int(tokens[child])]) == 1:
                    visit(child)
                    self.matcher.rollback(1)

        visit(0)
        self._check()
        masks = bitmask_rows(bits, self.vocab_size)
        masks[~masks.any(-1)] = True         # rows never reached or allowing nothing: unmasked
        GRAMMAR_TIME.seconds += time.perf_counter() - start
        GRAMMAR_TIME.masks += n
        return masks

    def _fill(self, bits: np.ndarray, row: int) -> None:
        """The matcher's next-token bitmask into row ``row`` of ``bits`` ([n, W] int32, C order)."""
        self.matcher.unsafe_compute_mask_ptr(bits.ctypes.data + row * self.words * 4, self.words * 4)

    def _check(self) -> None:
        if self.matcher.is_error():       # a matcher in error stays there: one look after a walk is enough
            raise InvalidArgument(f"sampling.constraint is too costly to follow (the grammar engine's limit): "
                                  f"{self.matcher.get_error()[:200]}")


def bitmask_rows(bits: np.ndarray, vocab_size: int) -> torch.Tensor:
    """llguidance bitmasks [n, W] int32 (bit j of word w: token 32 w + j) as
    [n, vocab_size] bool (False past the tokenizer's ids). One conversion per
    tree: per-node tensor operations would cost more than the masks."""
    n = bits.shape[0]
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")    # little-endian words: token order
    if allowed.shape[1] < vocab_size:
        allowed = np.concatenate([allowed, np.zeros((n, vocab_size - allowed.shape[1]), dtype=np.uint8)], axis=1)
    return torch.from_numpy(allowed[:, :vocab_size].astype(bool))


def token_mask(matcher: llguidance.LLMatcher, vocab_size: int) -> torch.Tensor:
    """[vocab_size] bool of ``matcher``'s allowed next tokens (False past the tokenizer's ids)."""
    allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8) != 0
    if allowed.numel() >= vocab_size:
        return allowed[:vocab_size]
    return torch.cat([allowed, torch.zeros(vocab_size - allowed.numel(), dtype=torch.bool)])


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """logits [..., V] with the refused tokens at -inf (``allowed`` [..., V] bool,
    None: no constraint)."""
    if allowed is None:
        return logits
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


# -> log-probs [f, V] over the next token of each frontier node (``specdec.tree.build.ExpandFn``)
ExpandLike = Callable[[object], torch.Tensor]


def masked_expand(expand: ExpandLike, state: GrammarState) -> ExpandLike:
    """``expand`` with each frontier node's log-probs masked by the grammar along
    its own path and renormalised over the allowed tokens (a row where the
    grammar allows nothing is left as it is; one where it allows nothing the
    drafter would propose becomes uniform over the allowed tokens). Frontier nodes are named by pool id;
    a node's parent is always an earlier frontier's node (or the root)."""
    paths: dict[int, list[int]] = {0: []}      # pool id -> its path's tokens below the root

    def expand_masked(frontier) -> torch.Tensor:
        logp = expand(frontier)
        if logp.shape[-1] != state.vocab_size:       # a drafter's own vocabulary: left unmasked
            return logp
        start = time.perf_counter()
        nodes, tokens, parents = frontier.nodes.tolist(), frontier.tokens.tolist(), frontier.parents.tolist()
        rows = []
        for node, token, parent in zip(nodes, tokens, parents):
            path = [] if parent < 0 else paths.get(parent, []) + [token]
            paths[node] = path
            ended = state.matcher.is_stopped() or any(t in state.eos for t in path)
            consumed = state.matcher.try_consume_tokens(path) if path and not ended else 0
            row = torch.ones(logp.shape[-1], dtype=torch.bool)
            if consumed == len(path) and not ended:
                try:
                    row = state.mask()
                except InvalidArgument:         # the verifier refuses the request; this draft stays unmasked
                    pass
            if consumed:
                state.matcher.rollback(consumed)
            rows.append(row if bool(row.any()) else torch.ones_like(row))
        allowed = torch.stack(rows).to(logp.device)
        masked = mask_logits(logp.float(), allowed)
        # a row whose support the grammar refuses whole (an EAGLE-3 head's reduced
        # vocabulary) drafts from the allowed tokens alike: a forced token (JSON's
        # punctuation, keys) is then drafted, and accepted, whatever the head knows
        empty = ~torch.isfinite(masked).any(-1, keepdim=True)
        masked = torch.where(empty, torch.zeros_like(masked).masked_fill(~allowed, float("-inf")), masked)
        GRAMMAR_TIME.seconds += time.perf_counter() - start
        GRAMMAR_TIME.masks += len(rows)
        return masked - torch.logsumexp(masked, dim=-1, keepdim=True)

    return expand_masked
