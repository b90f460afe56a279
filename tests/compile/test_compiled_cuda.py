"""Compiled forwards on a CUDA device (``pytest -m cuda``; ``make test`` has no GPU
and deselects them): the compiled steps replayed as CUDA graphs
(``specdec.compile.cuda_graphs``) give the eager generations, token for token, greedy
and seeded-sampled, for a Llama, a hybrid sliding/full family with
soft-capping (a mask per layer type) and a q/k-norm family; a replay gives the
outputs of the step it recorded; a batch of sessions and the EAGLE head's
compiled levels run on graphs too."""

from __future__ import annotations

import pytest
import torch
from families import BY_NAME
from trees import assert_same_tree

from specdec.compile import batched, cuda_graphs, forwards, startup
from specdec.local import generate
from specdec.model import kv
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from specdec.tree.build import tree_from_lists
from drafter.eagle.eagle2 import EagleDrafter
from drafter.ngram import NgramDrafter
from verifier.engine import TargetModel, VerifierEngine

pytestmark = pytest.mark.cuda

PROMPTS = [[3, 17, 42, 9, 3, 17, 42, 9, 3], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5]]
TREE = TreeParams(total_tokens=6, depth=4)          # n-gram trees: verify widths 1..8


@pytest.fixture(scope="module", autouse=True)
def gpu():
    assert torch.cuda.is_available(), "the cuda tests need a CUDA device"


def compiled_target(path) -> TargetModel:
    """A target on the GPU with compiled forwards (graphs compiled on first use), checked against eager."""
    target = TargetModel(ModelSpec(str(path), device="cuda"))
    forward = forwards.CompiledForward(target.lm)
    assert startup.check_compiled(forward) is None
    target.compiled = forward
    return target


def graphed(forward: forwards.CompiledForward) -> list[cuda_graphs.GraphedStep]:
    steps = list(forward.steps.graphs.values())
    assert steps and all(isinstance(s, cuda_graphs.GraphedStep) for s in steps)
    assert not any(s.failed for s in steps)
    return steps


def tokens(verifier, drafter, params=SamplingParams(), tree=None, n=24):
    stop = StopCriteria(max_new_tokens=n, eos_ids=frozenset())
    return [generate(verifier, drafter, p, params, stop, tree).tokens for p in PROMPTS]


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3"])
def test_generations_on_cuda_graphs_are_the_eager_ones(family, family_dir, tiny_family):
    path = tiny_family["target"] if family == "llama" else family_dir(BY_NAME[family])
    eager = VerifierEngine(TargetModel(ModelSpec(str(path), device="cuda")))
    fast = VerifierEngine(compiled_target(path))
    ngram = NgramDrafter(fast.target.vocab_size)
    want = tokens(eager, None)
    assert tokens(fast, None) == want                                  # plain decoding
    assert tokens(fast, ngram, tree=TREE) == want                      # tree verifies
    sampled = SamplingParams(temperature=0.8, seed=7)
    assert tokens(fast, ngram, sampled, TREE) == tokens(eager, ngram, sampled, TREE)
    assert sum(s.replays for s in graphed(fast.target.compiled)) > 0


@torch.inference_mode()
def test_a_replay_gives_the_outputs_of_its_package(tiny_family):
    target = compiled_target(tiny_family["target"])
    forward = target.compiled
    cache = forward.new_cache(16)
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    target.lm.hidden(cache, ids[:, :5], torch.arange(5)[None], None)
    step = forward.steps.graphs[(1, forwards.MIN_CAPACITY)]          # compiled by the check at load
    records, replays = step.records, step.replays
    outs = []
    for _ in range(3):          # recorded for this buffer (answered directly), then two replays
        outs.append(forward.run(cache, ids[:, 5:], torch.tensor([[5]]), None))
        kv.truncate(cache, 5)
    # (the check's freed buffer may sit at this cache's address: then all three are replays)
    assert step.replays - replays >= 2 and step.records - records + step.replays - replays == 3
    for out in outs[1:]:
        assert torch.equal(out[0], outs[0][0]) and torch.equal(out[2], outs[0][2])
    eager = target.lm.new_cache()
    target.lm.hidden(eager, ids, torch.arange(6)[None], None)
    written = cache.fixed_buffers.stack[:, 0, :, :, :6]               # every layer's K, the step's slot too
    want = torch.stack([layer.keys[..., :6, :] for layer in eager.layers])
    assert torch.allclose(written, want, atol=1e-5)


def test_a_batch_verifies_row_by_row_on_cuda_graphs(tiny_family):
    """Batched graphs are ahead-of-time packages, which the GPU path does not
    use: a batch of sessions verifies row by row over the one-session graphs,
    each session getting what it gets alone on the eager target."""
    path = tiny_family["target"]
    eager = VerifierEngine(TargetModel(ModelSpec(str(path), device="cuda")))
    fast = VerifierEngine(compiled_target(path))
    assert not batched.compile_batches(fast.target.compiled)
    sids = ["a", "b", "c"]
    for sid, prompt in zip(sids, PROMPTS + [[7, 7, 7, 7]]):
        assert fast.prefill(sid, prompt, SamplingParams(), 40).token == eager.prefill(sid, prompt, SamplingParams(),
                                                                                      40).token
    gen = torch.Generator().manual_seed(0)
    for cycle in range(4):
        trees = []
        for sid in sids:
            size = (1, 6, 8)[cycle % 3]
            tokens = [eager.committed_tokens(sid)[-1]] + torch.randint(1, 60, (size - 1,), generator=gen).tolist()
            trees.append(tree_from_lists(tokens, [-1] + [max(0, i - 1 - i % 2) for i in range(1, size)]))
        for sid, tree, got in zip(sids, trees, fast.verify_batch(list(zip(sids, trees)))):
            assert not isinstance(got, Exception), got
            want = eager.verify(sid, tree)
            assert (got.accepted, got.tokens) == (want.accepted, want.tokens)
    assert all(fast.committed_tokens(sid) == eager.committed_tokens(sid) for sid in sids)
    assert sum(s.replays for s in graphed(fast.target.compiled)) > 0


def test_compiled_eagle_levels_on_cuda_graphs_draft_the_eager_trees(tiny_family):
    fast = EagleDrafter(tiny_family["eagle"], tiny_family["target"], device="cuda", compile="on")
    assert fast.compiled is not None
    slow = EagleDrafter(tiny_family["eagle"], tiny_family["target"], device="cuda")
    gen = torch.Generator().manual_seed(0)
    prompt = [int(t) for t in torch.randint(0, fast.vocab_size, (12,), generator=gen)]
    feats = torch.randn(11, fast.hidden_size, generator=gen)
    for d in (fast, slow):
        d.prefill("s", prompt, feats, greedy=True)
    for cycle in range(3):
        assert_same_tree(fast.draft("s", TreeParams(total_tokens=10, depth=4, expand_k=4)),
                         slow.draft("s", TreeParams(total_tokens=10, depth=4, expand_k=4)))
        commit = [int(t) for t in torch.randint(0, fast.vocab_size, (3,), generator=gen)]
        commit_feats = torch.randn(3, fast.hidden_size, generator=gen)
        for d in (fast, slow):
            d.commit("s", commit, commit_feats)
    steps = list(fast.compiled.steps.graphs.values())
    assert steps and all(isinstance(s, cuda_graphs.GraphedStep) and not s.failed for s in steps)
    assert any(s.replays for s in steps)
