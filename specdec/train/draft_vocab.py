"""The reduced draft vocabulary of an EAGLE-3 head, chosen by token frequency.

An EAGLE-3 head predicts over N draft ids instead of the target's V tokens
(the lm_head shrinks by V/N, the largest cost of a head step). The N ids are
the tokens seen most often in the training corpus, as the EAGLE-3 reference
counts them (``eagle/traineagle3/cnets.py``: the most common N tokens of the
training data). Draft ids are the chosen target ids in ascending order, and
two buffers map between the vocabularies:

  d2t [N] int64   draft id d -> target id d + d2t[d]   (an offset, as released heads store it)
  t2d [V] bool    whether target id t is in the draft vocabulary

Ascending order makes target logits restricted with ``logits[..., t2d]`` line
up with draft ids, which is how the training loss compares the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftVocab:
    """Draft ids -> target ids, and the frequency mass they cover."""

    target_ids: torch.Tensor      # [N] int64, ascending
    vocab_size: int               # V, the target's vocabulary
    coverage: float               # fraction of counted tokens whose id is in the draft vocabulary

    @property
    def d2t(self) -> torch.Tensor:
        """[N] int64 offsets: target id = draft id + d2t[draft id]."""
        return self.target_ids - torch.arange(len(self.target_ids))

    @property
    def t2d(self) -> torch.Tensor:
        """[V] bool: target ids inside the draft vocabulary."""
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.target_ids] = True
        return mask

    def __len__(self) -> int:
        return len(self.target_ids)


def token_counts(stream: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """How often each id occurs in a token stream: int64 [vocab_size]."""
    return torch.bincount(stream.long(), minlength=vocab_size)[:vocab_size]


def choose_draft_vocab(counts: torch.Tensor, size: int, keep: tuple[int, ...] = ()) -> DraftVocab:
    """The ``size`` most frequent ids of ``counts`` [V] (ties to the lower id),
    always including the ids in ``keep`` (such as the end-of-text token, which
    the head must be able to propose however rare it is)."""
    vocab_size = counts.shape[0]
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")
    keep = tuple(sorted({int(k) for k in keep if 0 <= k < vocab_size}))
    if len(keep) > size:
        raise ValueError(f"draft vocabulary of {size} cannot hold the {len(keep)} ids it must keep")
    # Stable sort by descending count: equal counts keep ascending id order.
    order = torch.sort(-counts.long(), stable=True).indices
    kept = torch.zeros(vocab_size, dtype=torch.bool)
    kept[list(keep)] = True
    rest = order[~kept[order]][: size - len(keep)]
    ids = torch.sort(torch.cat([torch.tensor(keep, dtype=torch.long), rest])).values
    total = int(counts.sum())
    coverage = float(counts[ids].sum()) / total if total else 0.0
    return DraftVocab(ids, vocab_size, coverage)


def draft_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """The target ids [N] a head's ``d2t`` offsets name."""
    return d2t.long() + torch.arange(len(d2t))
