"""Greedy speculative output is token-identical to plain greedy decoding of the
target, for every drafter and every tree method (DESIGN.md §3)."""

import random
import shutil

import pytest
import torch

from specdec.local import DrafterChoice, build_local, generate
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams
from specdec.request.params import METHODS, TreeParams
from specdec.tree.sizing import TreeSizer, sizes_up_to

N_PROMPTS, NEW_TOKENS = 8, 64
GREEDY = SamplingParams()


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(N_PROMPTS):
        n = int(torch.randint(2, 24, (1,), generator=gen))
        body = torch.randint(1, vocab, (n,), generator=gen).tolist()
        out.append(body + body[: n // 2])      # some repetition: gives the n-gram drafter matches
    return out


@pytest.fixture(scope="module")
def stacks(tiny_family):
    spec = ModelSpec(str(tiny_family["target"]))
    return {
        "eagle": build_local(spec, DrafterChoice("eagle", str(tiny_family["eagle"]))),
        "draft-lm": build_local(spec, DrafterChoice("draft-lm", str(tiny_family["draft-lm"]))),
        "ngram": build_local(spec, DrafterChoice("ngram")),
    }


@pytest.fixture(scope="module")
def reference(stacks):
    verifier = stacks["eagle"].verifier
    stop = StopCriteria(max_new_tokens=NEW_TOKENS)
    return [generate(verifier, None, p, GREEDY, stop, None).tokens for p in prompts(verifier.target.vocab_size)]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("drafter", ["eagle", "draft-lm", "ngram"])
def test_greedy_identical_to_vanilla(stacks, reference, drafter, method):
    stack = stacks[drafter]
    cfg = TreeParams(method=method, total_tokens=10, depth=4, expand_k=3)
    stop = StopCriteria(max_new_tokens=NEW_TOKENS)
    for prompt, want in zip(prompts(stack.verifier.target.vocab_size), reference):
        got = generate(stack.verifier, stack.drafter, prompt, GREEDY, stop, cfg)
        assert got.tokens == want, f"{drafter}/{method} diverged on prompt {prompt}"
        assert len(got.tokens) == NEW_TOKENS
    assert len(stack.verifier.sessions) == 0 and len(stack.drafter.sessions) == 0


@pytest.mark.parametrize("value_temperature", [0.2, 3.0])
@pytest.mark.parametrize("drafter", ["eagle", "draft-lm"])
def test_greedy_identical_whatever_the_value_temperature(stacks, reference, drafter, value_temperature):
    stack = stacks[drafter]
    cfg = TreeParams(total_tokens=10, depth=4, expand_k=3, value_temperature=value_temperature)
    stop = StopCriteria(max_new_tokens=NEW_TOKENS)
    for prompt, want in zip(prompts(stack.verifier.target.vocab_size), reference):
        assert generate(stack.verifier, stack.drafter, prompt, GREEDY, stop, cfg).tokens == want


@pytest.mark.parametrize("drafter", ["eagle", "ngram"])
def test_greedy_identical_with_drafting_paused_by_the_gate(stacks, reference, drafter):
    stack = stacks[drafter]
    cfg = TreeParams(total_tokens=10, depth=4, expand_k=3)
    stop = StopCriteria(max_new_tokens=NEW_TOKENS)
    for prompt, want in zip(prompts(stack.verifier.target.vocab_size), reference):
        gated = generate(stack.verifier, stack.drafter, prompt, GREEDY, stop, cfg, min_tau=100.0)
        assert gated.tokens == want
        assert gated.stats.drafted < generate(stack.verifier, stack.drafter, prompt, GREEDY, stop, cfg).stats.drafted


def test_vanilla_matches_plain_hf_loop(tiny_family, reference):
    """The baseline itself is plain decoding: argmax of a full-sequence forward each step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_family["target"], dtype=torch.float32).eval()
    for prompt, want in list(zip(prompts(model.config.vocab_size), reference))[:3]:
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert seq[len(prompt):] == want


def greedy_chain_length(tree) -> int:
    """Depth reached by following each node's first child: the draft model's
    own top-1 continuation inside the tree (children are in rank order)."""
    children = tree.children()
    node, depth = 0, 0
    while children[node]:
        node, depth = children[node][0], depth + 1
    return depth


class Recording:
    """Wraps a drafter and remembers every tree it produced."""

    def __init__(self, inner):
        self.inner, self.trees = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, sid, cfg, deferred=False):          # (a tree read at once: ``deferred`` allows, not asks)
        tree = self.inner.draft(sid, cfg)
        self.trees.append(tree)
        return tree


@pytest.mark.parametrize("method", ["chain", "eagle2", "static", "no-rerank"])
def test_copy_of_target_as_drafter_accepts_its_whole_greedy_chain(tiny_family, tmp_path, method):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_family["target"], copy)
    stack = build_local(ModelSpec(str(tiny_family["target"])), DrafterChoice("draft-lm", str(copy)))
    cfg = TreeParams(method=method, total_tokens=12, depth=4, expand_k=3)
    for prompt in prompts(stack.verifier.target.vocab_size)[:5]:
        drafter = Recording(stack.drafter)
        dec = generate(stack.verifier, drafter, prompt, GREEDY, StopCriteria(max_new_tokens=40), cfg)
        accepted = [c - 1 for c in dec.stats.committed_per_cycle]
        chains = [greedy_chain_length(t) for t in drafter.trees]
        # a final cycle with one token left to generate drafts nothing
        assert accepted == chains + [0] * (len(accepted) - len(chains))
        if method == "chain":   # a chain is all greedy chain: every draft token accepted
            assert dec.stats.accepted == dec.stats.drafted > 0


class RandomCuts(TreeSizer):
    """Cuts every greedy tree to a size drawn at random (seeded): any cut must keep greedy output exact."""

    def __init__(self, seed: int):
        super().__init__()
        self.draws = random.Random(seed)
        self.rate = 1.0

    def _choose(self, accept, rate, cap):
        return self.draws.choice(sizes_up_to(cap))


@pytest.mark.parametrize("method", ["eagle2", "static", "chain"])
@pytest.mark.parametrize("drafter", ["eagle", "draft-lm", "ngram"])
def test_greedy_identical_with_trees_cut_by_the_verifier(stacks, reference, drafter, method, monkeypatch):
    stack = stacks[drafter]
    monkeypatch.setattr(stack.verifier, "sizer", RandomCuts(seed=len(drafter)))
    verified = []
    run = stack.verifier.verify

    def verify(sid, tree):
        verified.append(tree.size)
        result = run(sid, tree)
        assert result.tokens[:-1] == [int(tree.tokens[i]) for i in result.accepted]
        return result

    monkeypatch.setattr(stack.verifier, "verify", verify)
    cfg = TreeParams(method=method, total_tokens=10, depth=4, expand_k=3)
    stop = StopCriteria(max_new_tokens=NEW_TOKENS)
    for prompt, want in zip(prompts(stack.verifier.target.vocab_size), reference):
        got = generate(stack.verifier, stack.drafter, prompt, GREEDY, stop, cfg)
        assert got.tokens == want, f"{drafter}/{method} diverged on prompt {prompt} with cut trees"
        # the stats count the nodes verified, not those drafted
        assert got.stats.drafted == sum(n - 1 for n in verified[-got.stats.cycles:])
    assert {1, 2, 4} <= set(verified)                    # trees were cut, to every size
    assert len(stack.verifier.sessions) == 0 and len(stack.verifier.sizer.sessions) == 0
