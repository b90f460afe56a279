"""The sampling processors against plain-Python references: logit bias and
penalties, their order with temperature / top-k / top-p / min-p, per-node
tree counts (on the host and on the device), logprobs, the new parameters' bounds and choice seeds."""

import math
from dataclasses import replace

import pytest
import torch

from specdec.request.errors import InvalidArgument
from specdec.request.params import MAX_LOGPROBS, ChatMessage, GenerationRequest, SamplingParams, choice_seed
from specdec.tree.build import tree_from_lists
from specdec.tree.placed import SEEN, TOKENS, place_tree
from specdec.tree.proposals import ProposalSampler
from specdec.tree.sampling import (History, bias_logits, greedy_tokens, logit_bias_vector, penalize, target_probs,
                                   token_logprobs)

V = 12


def reference_probs(logits: list[float], history: list[int], prompt_len: int, p: SamplingParams) -> list[float]:
    """One row in plain Python: the documented order, token by token."""
    generated = history[prompt_len:]
    bias = dict(p.logit_bias)
    out = []
    for tok, x in enumerate(logits):
        x += bias.get(tok, 0.0)
        if tok in history:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        count = generated.count(tok)
        x -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
        out.append(x / p.temperature)
    keep = sorted(range(V), key=lambda i: -out[i])
    if p.top_k:
        keep = keep[:p.top_k]

    def norm(kept):
        top = max(out[i] for i in kept)
        w = [math.exp(out[i] - top) if i in kept else 0.0 for i in range(V)]
        return [x / sum(w) for x in w]

    probs = norm(set(keep))
    nucleus, mass = set(), 0.0
    for i in keep:
        if mass >= p.top_p:
            break
        nucleus.add(i)
        mass += probs[i]
    probs = norm(nucleus)
    top = max(probs)
    return norm({i for i in nucleus if probs[i] >= p.min_p * top})


CASES = [
    SamplingParams(temperature=1.0, repetition_penalty=1.7),
    SamplingParams(temperature=0.7, frequency_penalty=0.9, presence_penalty=-0.3),
    SamplingParams(temperature=1.3, repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=2.0),
    SamplingParams(temperature=1.0, top_k=6, top_p=0.8, min_p=0.1, repetition_penalty=1.2, frequency_penalty=0.5),
    SamplingParams(temperature=0.5, min_p=0.3, presence_penalty=1.0),
    SamplingParams(temperature=0.9, logit_bias={0: 3.0, 5: -2.5, 11: 100.0}),
    SamplingParams(temperature=1.1, top_k=5, top_p=0.9, logit_bias={2: 4.0, 7: -100.0}, repetition_penalty=1.4,
                   frequency_penalty=0.6),
]


@pytest.mark.parametrize("params", CASES)
def test_target_probs_match_the_reference_order(params):
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        logits = torch.randn(V, generator=g) * 2
        history = torch.randint(0, V, (9,), generator=g).tolist()
        counts = History(V, history, prompt_len=4).counts()
        got = target_probs(logits, params, counts)
        want = torch.tensor(reference_probs(logits.tolist(), history, 4, params))
        assert torch.allclose(got, want, atol=1e-6)


def test_repetition_penalty_covers_the_prompt_others_only_generated_tokens():
    logits = torch.zeros(V) + 1.0
    counts = History(V, [1, 2, 3], prompt_len=3).counts()
    rep = penalize(logits, SamplingParams(repetition_penalty=2.0), counts)
    assert rep[[1, 2, 3]].tolist() == [0.5] * 3 and rep[0] == 1.0
    freq = penalize(logits, SamplingParams(frequency_penalty=1.0, presence_penalty=1.0), counts)
    assert torch.equal(freq, logits)                 # nothing generated yet


def test_greedy_takes_the_argmax_of_the_penalised_logits():
    logits = torch.tensor([0.0, 3.0, 2.5] + [0.0] * (V - 3))
    counts = History(V, [5, 1], prompt_len=1).counts()  # token 1 generated once
    assert int(greedy_tokens(logits, SamplingParams(), counts)) == 1
    assert int(greedy_tokens(logits, SamplingParams(presence_penalty=1.0), counts)) == 2
    one_hot = target_probs(logits, SamplingParams(presence_penalty=1.0), counts)
    assert one_hot.tolist() == [0.0, 0.0, 1.0] + [0.0] * (V - 3)


def test_greedy_takes_the_argmax_of_the_biased_logits():
    logits = torch.tensor([0.0, 3.0, 2.5] + [0.0] * (V - 3))
    assert int(greedy_tokens(logits, SamplingParams(logit_bias={1: -100}))) == 2
    assert int(greedy_tokens(logits, SamplingParams(logit_bias={9: 3.5}))) == 9
    rows = torch.stack([logits, logits.flip(0)])                       # [2, V]: the same bias on every row
    assert greedy_tokens(rows, SamplingParams(logit_bias={1: -100, 10: -100})).tolist() == [2, 9]
    # bias, then penalty: token 4 (in the prompt) gets (3 + 2) / 2 = 2.5 < 3, not 3 / 2 + 2 = 3.5
    tied = torch.tensor([0.0, 3.0, 0.0, 0.0, 3.0] + [0.0] * (V - 5))
    counts = History(V, [4], prompt_len=1).counts()
    assert int(greedy_tokens(tied, SamplingParams(logit_bias={4: 2.0}, repetition_penalty=2.0), counts)) == 1


def test_logit_bias_vector_drops_ids_past_the_width():
    bias = ((1, 2.0), (V + 3, 5.0))       # a drafter narrower than the target's vocabulary
    assert logit_bias_vector(bias, V, torch.device("cpu")).tolist() == [0.0, 2.0] + [0.0] * (V - 2)
    assert bias_logits(torch.zeros(V), SamplingParams()).tolist() == [0.0] * V


def test_sampled_proposals_are_biased_too():
    logp = torch.log_softmax(torch.zeros(2, V), -1)
    params = SamplingParams(temperature=1.0, logit_bias={3: -100.0, 4: 100.0}, presence_penalty=1.0, seed=1)
    tokens, probs = ProposalSampler(params, seed=1, support=V).proposals(logp)
    assert tokens[:, 0].tolist() == [4, 4] and bool((probs[:, 0] > 0.99).all())


def test_penalties_without_counts_are_refused():
    with pytest.raises(ValueError, match="counts"):
        target_probs(torch.zeros(V), SamplingParams(temperature=1.0, presence_penalty=0.5))
    assert torch.allclose(target_probs(torch.zeros(V), SamplingParams(temperature=1.0, min_p=0.5)),
                          torch.full((V,), 1 / V))


def test_node_counts_are_each_nodes_own_path():
    #      0(root=7) -> 1(tok 3) -> 3(tok 3) -> 5(tok 4)
    #               \-> 2(tok 4) -> 4(tok 7)
    tree = tree_from_lists([7, 3, 4, 3, 7, 4], [-1, 0, 0, 1, 2, 3])
    history = History(V, [9, 9, 7], prompt_len=2)     # prompt 9 9, generated 7 (the root)
    counts = history.node_counts(tree.tokens, tree.ancestor_mask())
    paths = {0: [], 1: [3], 2: [4], 3: [3, 3], 4: [4, 7], 5: [3, 3, 4]}
    for node, path in paths.items():
        want = History(V, [9, 9, 7] + path, prompt_len=2).counts()
        assert torch.equal(counts.generated[node], want.generated), node
        assert torch.equal(counts.seen[node], want.seen), node
    assert torch.equal(history.counts().generated, History(V, [9, 9, 7], 2).generated)   # unchanged


@pytest.mark.parametrize("seed", range(6))
def test_counts_of_a_placed_tree_are_the_node_counts_and_advance_commits_a_path(seed):
    """On the device (``History.placed_counts`` from the placed bit sets,
    ``advance`` from a node and a bonus): the host's counts, path by path."""
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 64, (1,), generator=gen))                # up to a 64-wide placed tree (bit 63)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    tokens = torch.randint(0, V, (n,), generator=gen).tolist()
    tree = tree_from_lists(tokens, parents)
    committed = torch.randint(0, V, (9,), generator=gen).tolist() + [tokens[0]]
    history = History(V, committed, prompt_len=4)
    placed = place_tree(tree, len(committed) - 1, 64, "cpu")
    want = history.node_counts(tree.tokens, tree.ancestor_mask())
    got = history.placed_counts(placed.row(SEEN), placed.row(TOKENS))
    assert torch.equal(got.generated, want.generated) and torch.equal(got.seen, want.seen)
    last, bonus = n - 1, int(torch.randint(0, V, (1,), generator=gen))
    path = [last]
    while parents[path[-1]] > 0:
        path.append(parents[path[-1]])
    history.advance(got, torch.tensor([last]), torch.tensor([bonus]))
    after = History(V, committed + [tokens[i] for i in reversed(path)] + [bonus], prompt_len=4)
    assert torch.equal(history.generated, after.generated) and torch.equal(history.seen, after.seen)


def test_token_logprobs_are_the_raw_log_softmax():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    entries = token_logprobs(logits, [4, 0, 11], 2)
    logp = torch.log_softmax(logits, -1)
    for row, (e, tok) in enumerate(zip(entries, [4, 0, 11])):
        assert e.token == tok and e.logprob == pytest.approx(float(logp[row, tok]), abs=1e-6)
        vals, idx = logp[row].topk(2)
        assert list(e.top_tokens) == idx.tolist() and list(e.top_logprobs) == pytest.approx(vals.tolist())
    assert token_logprobs(logits, [1, 2, 3], 0)[0].top_tokens == ()


@pytest.mark.parametrize("name,value", [
    ("min_p", -0.1), ("min_p", 1.01), ("min_p", math.nan), ("presence_penalty", 2.01),
    ("presence_penalty", -2.5), ("frequency_penalty", math.inf), ("frequency_penalty", math.nan),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("repetition_penalty", math.nan), ("min_p", True),
])
def test_new_sampling_bounds_name_the_field(name, value):
    with pytest.raises(InvalidArgument, match=rf"^sampling\.{name} must be"):
        replace(SamplingParams(), **{name: value}).validate("sampling")


def test_new_sampling_bounds_accept_their_range():
    for kw in ({"min_p": 0.0}, {"min_p": 1.0}, {"presence_penalty": -2.0}, {"frequency_penalty": 2.0},
               {"repetition_penalty": 1e-3}, {"repetition_penalty": 50.0}):
        SamplingParams(**kw).validate()
    assert not SamplingParams(min_p=0.5).penalized and SamplingParams(repetition_penalty=1.1).penalized
    assert not SamplingParams(presence_penalty=1.0).without_penalties().penalized


@pytest.mark.parametrize("kwargs,message", [
    ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"n": 0}, "n must"),
    ({"n": 100}, "n must"), ({"prompt": "", "prompt_ids": (1, -2)}, r"prompt_ids\[1\]"),
    ({"prompt": "", "messages": (ChatMessage("bot", "x"),)}, r"messages\[0\]\.role"),
    ({"prompt_ids": (1,)}, "give one of"), ({"prompt": ""}, "prompt must not be empty"),
])
def test_generation_request_new_bounds(kwargs, message):
    with pytest.raises(InvalidArgument, match=message):
        GenerationRequest(**{"prompt": "x", **kwargs})


def test_generation_request_prompt_forms():
    assert GenerationRequest(prompt_ids=(0, 5)).prompt_ids == (0, 5)
    assert GenerationRequest(messages=[ChatMessage("user", "hi")]).messages == (ChatMessage("user", "hi"),)
    assert GenerationRequest("x", logprobs=MAX_LOGPROBS, n=16).n == 16


def test_choice_seeds_keep_choice_zero_and_differ():
    assert choice_seed(42, 0) == 42
    seeds = [choice_seed(42, i) for i in range(16)]
    assert len(set(seeds)) == 16 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [choice_seed(42, i) for i in range(16)]
    assert choice_seed(2**64 - 1, 3) < 2**63
