"""EAGLE-3 drafting in-process: greedy output identical to plain decoding, the
features reaching the head at the right layers and positions, the reduced
draft vocabulary mapped to the right target ids."""

import pytest
import torch

from specdec.local import DrafterChoice, build_local, generate
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import METHODS, SamplingParams, TreeParams
from specdec.tree.build import tree_from_lists
from drafter.eagle.eagle2 import EagleDrafter
from drafter.eagle.eagle3 import Eagle3Drafter, is_eagle3_head, load_eagle_drafter
from drafter.eagle.eagle3_head import load_head3

from eagle3_family import DRAFT_VOCAB, TARGET_LAYERS

GREEDY = SamplingParams()
NEW_TOKENS = 32
CFG = TreeParams(total_tokens=12, depth=4, expand_k=4)


def prompts(vocab: int, n: int = 6) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(1, vocab, (int(torch.randint(2, 20, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def stacks(family3):
    spec = ModelSpec(str(family3["target"]))
    return {name: build_local(spec, DrafterChoice("eagle", str(family3[name]))) for name in ("eagle3", "eagle3-full")}


@pytest.fixture(scope="module")
def vanilla(stacks):
    verifier = stacks["eagle3"].verifier
    stop = StopCriteria(max_new_tokens=NEW_TOKENS)
    return [generate(verifier, None, p, GREEDY, stop, None).tokens for p in prompts(verifier.target.vocab_size)]


def test_eagle_dir_tells_the_versions_apart(family3):
    assert is_eagle3_head(family3["eagle3"]) and not is_eagle3_head(family3["eagle"])
    assert type(load_eagle_drafter(family3["eagle3"], family3["target"])) is Eagle3Drafter
    assert type(load_eagle_drafter(family3["eagle"], family3["target"])) is EagleDrafter


@pytest.mark.parametrize("lookahead", [0, 2])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("head", ["eagle3", "eagle3-full"])
def test_greedy_identical_to_vanilla(stacks, vanilla, head, method, lookahead):
    stack, stop = stacks[head], StopCriteria(max_new_tokens=NEW_TOKENS)
    cfg = TreeParams(method=method, total_tokens=12, depth=4, expand_k=4)
    for prompt, want in zip(prompts(stack.verifier.target.vocab_size), vanilla):
        got = generate(stack.verifier, stack.drafter, prompt, GREEDY, stop, cfg, lookahead=lookahead)
        assert got.tokens == want, f"{head}/{method} diverged on prompt {prompt}"
    assert len(stack.verifier.sessions) == 0 and len(stack.drafter.sessions) == 0


def test_first_level_is_accepted_exactly_when_the_target_picks_a_draft_id(stacks):
    """A first level holding the whole draft vocabulary: the verifier accepts a
    child exactly when the target's greedy token is a draft id mapped through
    d2t, so every cycle tells whether the mapping is right."""
    stack = stacks["eagle3"]
    drafter, verifier = stack.drafter, stack.verifier
    allowed = set(drafter.head.to_target_ids(torch.arange(DRAFT_VOCAB)).tolist())
    cfg = TreeParams(total_tokens=DRAFT_VOCAB + 1, depth=1, expand_k=DRAFT_VOCAB)
    seen = {True: 0, False: 0}
    for n, prompt in enumerate(prompts(verifier.target.vocab_size)):
        first = verifier.prefill("v", prompt, GREEDY, feature_layers=drafter.feature_layers)
        drafter.prefill("d", prompt + [first.token], first.features)
        for _ in range(12):
            tree = drafter.draft("d", cfg)
            assert set(tree.tokens[1:].tolist()) == allowed
            result = verifier.verify("v", tree)
            hit = result.tokens[0] in allowed
            assert (len(result.tokens) == 2) == hit, (result.tokens, hit)
            seen[hit] += 1
            drafter.commit("d", result.tokens, result.features)
        verifier.release("v")
        drafter.release("d")
    assert seen[True] and seen[False]


def test_commits_fed_cycle_by_cycle_draft_what_one_prefill_drafts(stacks):
    """A session that took its features over several commits drafts the same
    tree as a fresh one prefilled with all of them (a failover's re-prefill)."""
    drafter, verifier = stacks["eagle3"].drafter, stacks["eagle3"].verifier
    prompt = [4, 8, 15, 16, 23, 42]
    first = verifier.prefill("v", prompt, GREEDY, feature_layers=drafter.feature_layers)
    assert first.features.shape == (len(prompt), drafter.feature_size)
    tokens, feats = prompt + [first.token], [first.features]
    drafter.prefill("a", tokens, first.features)
    for _ in range(4):
        result = verifier.verify("v", drafter.draft("a", CFG))
        drafter.commit("a", result.tokens, result.features)
        tokens += result.tokens
        feats.append(result.features)
    drafter.prefill("b", tokens, torch.cat(feats))
    a, b = drafter.draft("a", CFG), drafter.draft("b", CFG)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    torch.testing.assert_close(a.values, b.values, rtol=1e-4, atol=1e-5)
    for sid in ("a", "b"):
        drafter.release(sid)
    verifier.release("v")


def test_root_distribution_pairs_each_feature_with_the_next_token(stacks):
    """The root's children come from the head run over (fc(F_t), x_{t+1}) for every
    committed t, the last output read through the head's norm and lm_head and
    placed at target ids."""
    drafter, verifier = stacks["eagle3"].drafter, stacks["eagle3"].verifier
    prompt = [9, 8, 7, 6, 5, 4, 3]
    first = verifier.prefill("v", prompt, GREEDY, feature_layers=drafter.feature_layers)
    verifier.release("v")
    tokens = prompt + [first.token]
    drafter.prefill("d", tokens, first.features)
    tree = drafter.draft("d", TreeParams(total_tokens=5, depth=1, expand_k=4))
    drafter.release("d")
    head = drafter.head
    with torch.inference_mode():
        out = head(head.embed_tokens(torch.tensor([tokens[1:]])), head.project(first.features)[None],
                   torch.arange(len(prompt))[None])[0, -1]
        draft_logp = torch.log_softmax(head.draft_logits(out), -1)
    best = head.to_target_ids(draft_logp.topk(4).indices)
    assert tree.tokens[1:].tolist() == best.tolist()
    torch.testing.assert_close(tree.values[1:], draft_logp.topk(4).values, rtol=1e-4, atol=1e-5)


def test_features_are_the_hf_hidden_states_of_the_drafters_layers(stacks):
    verifier, layers = stacks["eagle3"].verifier, stacks["eagle3"].drafter.feature_layers
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    got = verifier.prefill("v", prompt, GREEDY, feature_layers=layers).features
    verifier.release("v")
    with torch.no_grad():
        states = verifier.target.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(got, torch.cat([states[i][0] for i in layers], dim=-1), rtol=1e-4, atol=1e-5)


def test_batched_verify_gives_each_session_its_own_layers(stacks):
    """Sessions asking for different layers (none: the final hidden state) in one
    batched forward get exactly the features each gets verified alone."""
    verifier = stacks["eagle3"].verifier
    choices = [(), (2, 3, 3), (0, 5, 1), (4,)]
    prompts = [[5, 6, 7], [20, 21, 22, 20, 21], [3] * 9, [100, 50, 25]]
    trees, solo = [], []
    for n, (layers, prompt) in enumerate(zip(choices, prompts)):
        first = verifier.prefill(f"solo{n}", prompt, GREEDY, feature_layers=layers)
        verifier.prefill(f"batch{n}", prompt, GREEDY, feature_layers=layers)
        tree = tree_from_lists([first.token, 7, 8, 9], [-1, 0, 0, 1])
        trees.append(tree)
        solo.append(verifier.verify(f"solo{n}", tree))
    batched = verifier.verify_batch([(f"batch{n}", tree) for n, tree in enumerate(trees)])
    h = verifier.target.config.hidden_size
    for layers, alone, together in zip(choices, solo, batched):
        assert together.tokens == alone.tokens
        assert together.features.shape[-1] == h * max(1, len(layers))
        torch.testing.assert_close(together.features, alone.features, rtol=1e-4, atol=1e-5)
    for n in range(len(choices)):
        verifier.release(f"solo{n}")
        verifier.release(f"batch{n}")


def test_head_built_without_layers_reads_the_references(family3):
    head = load_head3(family3["eagle3"])
    head.layers = ()
    drafter = Eagle3Drafter(None, family3["target"], head=head)
    assert drafter.feature_layers == (2, TARGET_LAYERS // 2, TARGET_LAYERS - 3)
