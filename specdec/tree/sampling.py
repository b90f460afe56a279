"""Target-side sampling: the processed target distribution, penalty counts, logprobs, draws.

`target_probs` turns verifier logits into the distribution the target model
would sample from in plain decoding. Speculative acceptance is lossless with
respect to *this* distribution, so plain decoding (a root-only tree) and tree
verification call the same function. The processors, in order
(`target_probs`):

0. grammar mask (a constrained session, ``specdec.tree.grammar``): tokens the
   grammar refuses after the node's own path get logit -inf, first, as vLLM
   applies its grammar bitmask before the sampling processors (every later
   step keeps -inf at -inf, so they stay at probability 0);
1. logit bias (OpenAI): ``logit_bias``'s value added to each listed token's
   logit (before the penalties, as vLLM orders them);
2. repetition penalty (transformers / vLLM): a token that occurs in the prompt
   or the generated tokens has its logit divided by the penalty when positive,
   multiplied by it otherwise;
3. frequency and presence penalties (OpenAI): minus ``frequency_penalty`` times
   the token's count among the *generated* tokens, minus ``presence_penalty``
   once if that count is > 0;
4. temperature (greedy decoding stops here and takes the argmax);
5. top-k, then top-p (nucleus), then min-p (drop tokens below ``min_p`` times
   the most likely token's probability), renormalised.

The logit bias reads no history: it is the same at every tree node, and a
drafter's sampled proposals (``specdec.tree.proposals``) apply it too.

Penalties read the tokens before the position being sampled. In a draft tree
those differ per node: node u's history is the committed sequence (root
included) followed by the tokens on the path from the root down to u.
`History.node_counts` builds those per-node counts [n, V] from the session's
committed counts plus each node's path tokens, so the distribution at every
node is exactly the one plain decoding would use after that path.

Logprobs (`token_logprobs`) come from the raw model: the log-softmax of the
target's fp32 logits, before any processor (grammar mask and logit bias
included), as vLLM returns them by default.

All randomness flows through an explicit `torch.Generator` so that a seed
reproduces a whole generation; see `make_generator`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch

from specdec.request.params import SamplingParams, TokenLogprob
from specdec.tree.grammar import mask_logits


@dataclass(frozen=True)
class TokenCounts:
    """What penalties read, for one position or one per row ([..., V] each):
    ``generated`` counts each token among the generated tokens (float32),
    ``seen`` marks tokens that occur in the prompt or the generated tokens."""

    generated: torch.Tensor
    seen: torch.Tensor


class History:
    """A session's committed tokens as penalty counts, kept up to date per commit.

    ``prompt_len`` tokens of the sequence are the prompt (repetition penalty
    only); the rest are generated (every penalty). The counts live on
    ``device`` (the model's): a tree placed there gets its per-node counts and
    commits its path without the host (``placed_counts``, ``advance``)."""

    def __init__(self, vocab_size: int, tokens: list[int], prompt_len: int, device="cpu"):
        self.vocab_size, self.prompt_len = vocab_size, prompt_len
        self.device = torch.device(device)
        self.generated = torch.zeros(vocab_size, device=self.device)
        self.prompt_seen = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
        self.prompt_seen[torch.tensor(tokens[:prompt_len], dtype=torch.long, device=self.device)] = True
        self.extend(tokens[prompt_len:])

    @property
    def seen(self) -> torch.Tensor:
        """[V] bool: in the prompt or generated."""
        return self.prompt_seen | (self.generated > 0)

    def extend(self, tokens: list[int]) -> None:
        """Generated tokens, committed (host ids: one upload)."""
        if tokens:
            ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
            self.generated.index_add_(0, ids, torch.ones(len(tokens), device=self.device))

    def counts(self) -> TokenCounts:
        """The counts at the next position to sample ([V])."""
        return TokenCounts(self.generated, self.seen)

    def node_counts(self, tokens: torch.Tensor, ancestors: torch.Tensor) -> TokenCounts:
        """Per-node counts [n, V] of a tree whose root (node 0) is the last
        committed token: the committed counts plus, for node u, the tokens of
        u and of its ancestors below the root (the path the distribution at u
        follows). tokens: [n] int64; ancestors: [n, n] bool, row u True at u and
        its ancestors (``DraftTree.ancestor_mask``; host tensors)."""
        n = tokens.shape[0]
        generated = self.generated.expand(n, -1).clone()
        if n > 1:
            rows, cols = ancestors[:, 1:].nonzero(as_tuple=True)   # node, path node - 1 (root excluded)
            path_tokens = tokens[1:].to(torch.long)[cols]
            generated.index_put_((rows.to(self.device), path_tokens.to(self.device)),
                                 torch.ones(len(rows), device=self.device), accumulate=True)
        return TokenCounts(generated, self.prompt_seen | (generated > 0))

    def placed_counts(self, seen_bits: torch.Tensor, tokens: torch.Tensor) -> TokenCounts:
        """``node_counts`` of a tree placed on the device (``specdec.tree.placed``:
        its nodes' SEEN bit sets and tokens [n], on ``device``), from nothing on
        the host: node u's row adds the tokens of the nodes whose bits u sees,
        the root's left out."""
        n = tokens.shape[0]
        index = torch.arange(n, device=self.device)
        below_root = (torch.bitwise_right_shift(seen_bits[:, None], index) & 1).bool() & (index > 0)   # [n, n]
        generated = self.generated.expand(n, -1).clone().scatter_add_(
            1, tokens[None].expand(n, n), below_root.to(self.generated.dtype))
        return TokenCounts(generated, self.prompt_seen | (generated > 0))

    def advance(self, counts: TokenCounts, last: torch.Tensor, bonus: torch.Tensor) -> None:
        """A cycle's commit on the device: the path to node ``last`` [1] (its row
        of ``counts``, the cycle's ``placed_counts``), then the bonus token [1]."""
        self.generated = counts.generated.index_select(0, last)[0].index_add_(
            0, bonus, torch.ones(1, device=self.device))


# Dense bias vectors kept per (bias, vocabulary, device): a session's vector is built
# (and copied to its device) once, not at every step.
@lru_cache(maxsize=16)
def logit_bias_vector(bias: tuple[tuple[int, float], ...], vocab: int, device: torch.device) -> torch.Tensor:
    """The (token id, bias) pairs as a dense fp32 vector [vocab] on ``device``.
    Ids past ``vocab`` are left out: a drafter's narrower vocabulary (the
    verifier refuses them before a session opens)."""
    kept = [(t, b) for t, b in bias if t < vocab]
    dense = torch.zeros(vocab)
    if kept:
        ids, values = zip(*kept)
        dense[torch.tensor(ids, dtype=torch.long)] = torch.tensor(values, dtype=torch.float32)
    return dense.to(device)


def bias_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Step 1 of the processors on fp32 logits [..., V]: ``params.logit_bias``
    added (a new tensor when there is one)."""
    if not params.logit_bias:
        return logits
    return logits + logit_bias_vector(params.logit_bias, logits.shape[-1], logits.device)


def penalize(logits: torch.Tensor, params: SamplingParams, counts: TokenCounts | None) -> torch.Tensor:
    """Steps 2-3 of the processors on fp32 logits [..., V] (a new tensor when
    any penalty is on). ``counts`` broadcasts against ``logits``; it may be None
    only when no penalty is on."""
    if not params.penalized:
        return logits
    if counts is None:
        raise ValueError("penalties need the token counts of the history")
    seen, generated = moved_to(counts.seen, logits.device), moved_to(counts.generated, logits.device)
    if params.repetition_penalty != 1.0:
        rep = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    if params.frequency_penalty != 0.0:
        logits = logits - params.frequency_penalty * generated
    if params.presence_penalty != 0.0:
        logits = logits - params.presence_penalty * (generated > 0).float()
    return logits


def adjusted_logits(logits: torch.Tensor, params: SamplingParams, counts: TokenCounts | None,
                    allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Steps 0-3 on logits [..., V], in fp32: masked by ``allowed`` ([..., V]
    bool, a constrained session's grammar mask; None: none), biased, then
    penalised (what greedy decoding takes the argmax of and temperature divides)."""
    return penalize(bias_logits(mask_logits(logits.float(), allowed), params), params, counts)


def target_probs(logits: torch.Tensor, params: SamplingParams, counts: TokenCounts | None = None,
                 allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Processed target distribution, fp32, same shape as `logits` [..., V].

    Greedy params give the one-hot of the argmax of the masked, biased,
    penalised logits (first index on ties), so that sampling-based code paths
    reduce exactly to greedy decoding. ``allowed`` [..., V] bool: the grammar
    mask of a constrained session (None: none).
    """
    params.validate()
    logits = adjusted_logits(logits, params, counts, allowed)
    vocab = logits.shape[-1]
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()

    scaled = logits / params.temperature
    if 0 < params.top_k < vocab:
        # topk keeps exactly k entries even when values tie at the boundary.
        top_vals, top_idx = scaled.topk(params.top_k, dim=-1)
        scaled = torch.full_like(scaled, float("-inf")).scatter_(-1, top_idx, top_vals)
    probs = torch.softmax(scaled, dim=-1)

    if params.top_p < 1.0:
        sorted_p, sorted_idx = probs.sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p  # [..., V] mass ranked above each token
        # The top token has mass_before == 0 < top_p, so it always survives.
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, sorted_idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.min_p > 0.0:
        # The most likely token passes (min_p <= 1), so no row becomes empty.
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def greedy_tokens(logits: torch.Tensor, params: SamplingParams, counts: TokenCounts | None = None,
                  allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy decoding's choice per row: the argmax of the masked, biased,
    penalised logits ([..., V] -> [...])."""
    return adjusted_logits(logits, params, counts, allowed).argmax(-1)


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """logits: [m, V] at the positions that produced ``tokens`` [m] -> one
    entry per token: log-softmax of the fp32 logits (raw model, no processor),
    with the top ``k`` alternatives, most likely first."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, torch.tensor(tokens, dtype=torch.long, device=logp.device)[:, None])[:, 0].tolist()
    if k > 0:
        top_vals, top_idx = logp.topk(min(k, logp.shape[-1]), dim=-1)
        top_vals, top_idx = top_vals.tolist(), top_idx.tolist()
    else:
        top_vals = top_idx = [[] for _ in tokens]
    return [TokenLogprob(t, lp, tuple(i), tuple(v)) for t, lp, i, v in zip(tokens, chosen, top_idx, top_vals)]


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token from `probs` [V] (need not be normalised) using `generator`,
    left on ``probs``' device: [1] int64."""
    return moved_to(torch.multinomial(moved_to(probs, generator.device), 1, generator=generator), probs.device)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """``draw``'s token, read."""
    return int(draw(probs, generator))


def moved_to(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` on ``device``: a copy only where it lives elsewhere (a session's
    generator on the model's device copies nothing)."""
    return x if x.device == device else x.to(device)


def make_generator(seed: int | None = None, device: str | torch.device = "cpu") -> torch.Generator:
    """A seeded generator; with seed=None a fresh seed is drawn from os.urandom.

    The seed actually used is `generator.initial_seed()`, so a run started
    without a seed can still be logged and replayed. Draws reproduce only on
    the same generator device.
    """
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") >> 1  # 63 bits: fits int64
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator
