"""Assertions on draft trees and drafters shared by the drafter tests, and a
verifier tree sizing that cuts every tree the same way."""

import torch

from specdec.tree.build import tree_from_lists
from specdec.tree.sizing import TreeSizer


class CutTo(TreeSizer):
    """A verifier's tree sizing (``specdec.tree.sizing``) that keeps the
    ``size`` best nodes of every greedy tree, whatever the timings."""

    def __init__(self, size: int):
        super().__init__()
        self.size, self.rate = size, 1.0

    def _choose(self, accept, rate, cap):
        return min(self.size, cap)


def assert_same_tree(got, want):
    """Two drafts are the same tree: tokens, parents and proposals exactly; values
    and proposal probabilities to float rounding (a padded or batched forward may
    sum in another order)."""
    assert not isinstance(got, Exception), got
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.parents.tolist() == want.parents.tolist()
    assert torch.allclose(got.values, want.values, rtol=0, atol=1e-4), (got.values - want.values).abs().max()
    assert (got.proposals or {}).keys() == (want.proposals or {}).keys()
    for node, prop in (got.proposals or {}).items():
        assert tie_groups(prop.tokens, prop.probs) == tie_groups(want.proposals[node].tokens,
                                                                want.proposals[node].probs), node
        assert torch.allclose(prop.probs, want.proposals[node].probs, rtol=0, atol=1e-5)


TIE_RTOL = 1e-4     # proposal probabilities this close are a tie that float rounding may order either way


def tie_groups(tokens, probs) -> list:
    """A proposal's tokens as runs of near-equal probabilities, each run a set:
    batched and solo forwards round differently, so two tokens whose
    probabilities differ by ~1e-6 relative may come in either order (the run
    that reaches the end of a cut proposal is compared by its size only: which
    of several tied tokens made the cut is rounding too)."""
    tokens, probs = tokens.tolist(), probs.tolist()
    groups, start = [], 0
    for i in range(1, len(tokens) + 1):
        if i == len(tokens) or abs(probs[i] - probs[i - 1]) > TIE_RTOL * max(probs[i], probs[i - 1]):
            groups.append(frozenset(tokens[start:i]))
            start = i
    if groups and len(groups[-1]) > 1:
        groups[-1] = len(groups[-1])
    return groups


def assert_drafts_plain_greedy(drafter, target_dir, tree):
    """Greedy generations with ``drafter`` over the target in ``target_dir``
    are plain greedy decoding's tokens, and the drafter did draft."""
    from specdec.request.decoding import StopCriteria
    from specdec.local import generate
    from specdec.model.loading import ModelSpec
    from specdec.request.params import SamplingParams
    from verifier.engine import TargetModel, VerifierEngine

    verifier = VerifierEngine(TargetModel(ModelSpec(str(target_dir))))
    stop = StopCriteria(max_new_tokens=24, eos_ids=frozenset())
    for prompt in ([3, 17, 42, 9, 3, 17, 42], [5, 6, 7, 8, 5, 6, 9, 11]):
        want = generate(verifier, None, prompt, SamplingParams(), stop, None).tokens
        got = generate(verifier, drafter, prompt, SamplingParams(), stop, tree)
        assert got.tokens == want and got.finish().drafted > 0       # a random drafter: few accepted


class ChainOracle:
    """A drafter that proposes the next ``depth`` tokens of known outputs (keyed
    by prompt) as a chain: drafting exactly what a correct verifier must accept,
    it makes every path token's processing (a penalty, a grammar mask) matter."""

    needs_features = False

    def __init__(self, outputs: dict[tuple[int, ...], list[int]]):
        self.outputs, self.seqs = outputs, {}

    def prefill(self, sid, tokens, features=None, sampling=None, cache_salt=""):
        prompt = tuple(tokens[:-1])
        self.seqs[sid] = (list(prompt) + self.outputs[prompt], list(tokens))

    def commit(self, sid, tokens, features=None):
        self.seqs[sid][1].extend(tokens)

    def draft(self, sid, cfg, ahead=False):
        full, done = self.seqs[sid]
        chain = full[len(done):len(done) + cfg.depth]
        return tree_from_lists([done[-1]] + chain, list(range(-1, len(chain))))

    def release(self, sid):
        return self.seqs.pop(sid, None) is not None
