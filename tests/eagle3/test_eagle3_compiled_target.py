"""Compiled verifies of EAGLE-3 sessions (``specdec.compile.forwards``'s capturing
graphs): the residual streams a compiled forward returns are the eager ones
(any layers, fewer than three too), generations with an EAGLE-3 head on a
compiled target are plain greedy decoding and, sampled, the eager stack's
tokens; without the capturing graphs those sessions verify eagerly (one log
line); a compiled verifier is told to build them for an EAGLE-3 head only."""

import argparse
import logging

import pytest
import torch

from specdec.compile.eager import eager_run
from specdec.compile import forwards, startup
from specdec.local import DrafterChoice, build_local, generate
from specdec.model.loading import ModelSpec
from specdec.model.masks import tree_allowed
from specdec.procs import feature_layer_flags
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from specdec.tree.build import tree_from_lists
from verifier.engine import TargetModel

GREEDY = SamplingParams()
NEW_TOKENS = 24
TREE = TreeParams(total_tokens=8, depth=4, expand_k=4)       # verifies 8 wide: one graph


def prompts(vocab: int, n: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(1, vocab, (int(torch.randint(3, 16, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def stacks(family3):
    """The eager stack and one whose target has only the capturing graphs
    (checked, warmed at the verify width: few cold builds), same weights."""
    choice = DrafterChoice("eagle", str(family3["eagle3"]))
    eager, fast = (build_local(ModelSpec(str(family3["target"])), choice) for _ in range(2))
    forward = forwards.CompiledForward(fast.verifier.target.lm)
    assert startup.compile_captures(forward, widths=(TREE.total_tokens,))
    forward.open_all()            # nothing left to open in the background: the forwards counted below are the tests'
    fast.verifier.target.compiled = forward
    return eager, fast


def test_an_in_process_eagle3_drafter_asks_its_target_for_the_capturing_graphs(family3, monkeypatch):
    asked = []
    monkeypatch.setattr(TargetModel, "compile_feature_layers", lambda self: asked.append(self) or False)
    stack = build_local(ModelSpec(str(family3["target"])), DrafterChoice("eagle", str(family3["eagle3"])))
    assert asked == [stack.verifier.target]
    build_local(ModelSpec(str(family3["target"])), DrafterChoice("eagle", str(family3["eagle"])))
    assert asked == [stack.verifier.target]                 # an EAGLE-2 head asks nothing


def test_the_capturing_graphs_serve_any_three_layers_or_fewer(stacks):
    forward = stacks[1].verifier.target.compiled
    assert forward.capturing is not None
    assert all(forward.captures(layers) for layers in [(), (0,), (5, 1), (1, 2, 3), tuple(stacks[1].drafter.feature_layers)])
    assert not forward.captures((0, 1, 2, 3))


@pytest.mark.parametrize("layers", [(1, 3, 5), (5, 0, 2), (2, 4), (3,)])
def test_compiled_forwards_return_the_eager_feature_layers(stacks, layers):
    """A one-token step and a tree over a cached prefix: logits and the streams
    entering ``layers`` (any order, fewer than three) as eager."""
    _, fast = stacks
    target = fast.verifier.target
    lm, forward = target.lm, target.compiled
    prefix = torch.randint(0, target.vocab_size, (9,), generator=torch.Generator().manual_seed(3))
    tree = tree_from_lists([int(prefix[-1]), 5, 7, 9], [-1, 0, 0, 1])
    with torch.inference_mode():
        outs = _step_and_tree(lm, forward, target, prefix, tree, layers)
    for got, want in zip(outs["compiled"], outs["eager"]):
        assert got[1].shape == want[1].shape == (1, got[1].shape[1], len(layers) * lm.config.hidden_size)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def _step_and_tree(lm, forward, target, prefix, tree, layers):
    outs = {}
    for name, run in (("compiled", forward.run), ("eager", lambda *a: eager_run(lm, *a))):
        cache = forward.new_cache(16)
        lm.hidden(cache, prefix[None, :7], torch.arange(7)[None], None)
        one = run(cache, prefix[None, 7:8], torch.tensor([[7]]), None, layers)
        assert one is not None, f"{name}: a step asking for layers {layers} took no path"
        pos = tree.position_ids(8)
        k_pos = torch.cat([torch.arange(8), pos])
        mask = target.masks(tree_allowed(tree.ancestor_mask(), 8)[None], pos[None], k_pos[None])
        outs[name] = one, run(cache, tree.tokens[None], pos[None], mask, layers)
    return outs


def test_greedy_generations_are_plain_greedy_decoding_on_the_capturing_graphs(stacks, monkeypatch):
    eager, fast = stacks
    forward = fast.verifier.target.compiled
    taken = []
    run = forward.run

    def counted(cache, tokens, positions, mask, layers=()):
        out = run(cache, tokens, positions, mask, layers)
        taken.append((bool(layers), out is not None))
        return out

    def counted_placed(cache, placed, layers=()):               # a tree placed on the device (greedy verifies)
        out = run_placed(cache, placed, layers)
        taken.append((bool(layers), True))
        return out

    run_placed = forward.run_placed
    monkeypatch.setattr(forward, "run", counted)
    monkeypatch.setattr(forward, "run_placed", counted_placed)
    stop = StopCriteria(max_new_tokens=NEW_TOKENS)
    cycles = 0
    for prompt in prompts(fast.verifier.target.vocab_size):
        want = generate(eager.verifier, None, prompt, GREEDY, stop, None).tokens
        got = generate(fast.verifier, fast.drafter, prompt, GREEDY, stop, TREE)
        assert got.tokens == want
        assert got.stats.drafted > 0                    # trees were verified (a random head: few accepted)
        cycles += got.stats.cycles
    # every forward asked for the head's layers, and took the compiled path, the prompts' prefills too
    assert [with_layers for with_layers, _ in taken] == [True] * len(taken)
    assert all(compiled_path for _, compiled_path in taken)
    assert len(taken) == cycles + len(prompts(fast.verifier.target.vocab_size))


def test_sampled_generations_are_the_eager_stacks_tokens(stacks):
    eager, fast = stacks
    stop = StopCriteria(max_new_tokens=NEW_TOKENS)
    for i, prompt in enumerate(prompts(fast.verifier.target.vocab_size)):
        params = SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i)
        want = generate(eager.verifier, eager.drafter, prompt, params, stop, TREE).tokens
        assert generate(fast.verifier, fast.drafter, prompt, params, stop, TREE).tokens == want


def test_without_the_capturing_graphs_those_sessions_verify_eagerly(stacks, monkeypatch, caplog):
    eager, fast = stacks
    target = fast.verifier.target
    monkeypatch.setattr(target.compiled, "capturing", None)
    monkeypatch.setattr(target, "_told_eager_layers", False)
    stop = StopCriteria(max_new_tokens=NEW_TOKENS)
    with caplog.at_level(logging.WARNING):
        for prompt in prompts(target.vocab_size, 2):
            want = generate(eager.verifier, None, prompt, GREEDY, stop, None).tokens
            assert generate(fast.verifier, fast.drafter, prompt, GREEDY, stop, TREE).tokens == want
    told = [r for r in caplog.records if "--compile-feature-layers" in r.getMessage()]
    assert len(told) == 1


def test_a_compiled_verifier_is_told_to_build_them_for_an_eagle3_head_only(family3):
    assert feature_layer_flags(str(family3["eagle3"]), "on") == ["--compile-feature-layers"]
    assert feature_layer_flags(str(family3["eagle3"]), "auto") == ["--compile-feature-layers"]
    assert feature_layer_flags(str(family3["eagle3"]), "off") == []
    assert feature_layer_flags(str(family3["eagle"]), "on") == []
    assert feature_layer_flags(None, "on") == []


@pytest.mark.parametrize("head,compile_mode,told", [("eagle3", "on", True), ("eagle", "on", False),
                                                    ("eagle3", "off", False)])
def test_up_and_soak_start_the_verifier_with_it_for_an_eagle3_head(family3, head, compile_mode, told):
    from specdec.cli.soak import _models
    from specdec.cli.up import _model_argv
    from specdec.request.lookahead import parse_lookahead

    args = argparse.Namespace(target=str(family3["target"]), eagle=str(family3[head]), draft_lm=None, ngram=False,
                              medusa=None, dtype="float32", weights="dtype", compile=compile_mode, method="eagle2",
                              prefix_cache_tokens=0, prefix_cache_exact=False, lookahead_wng=parse_lookahead("4,3,4"))
    verifier, drafter, _ = _model_argv(args)
    assert ("--compile-feature-layers" in verifier) is told and drafter[:2] == ["--eagle", str(family3[head])]
    assert ("--compile-feature-layers" in _models(args).verifier_argv) is told



@pytest.mark.parametrize("head, layers", [("eagle3", True), ("eagle", False)])
def test_the_startup_profile_starts_the_target_as_a_verifier_for_the_head_would(family3, tmp_path, capsys, head,
                                                                                  layers, monkeypatch):
    import json

    from specdec.bench import profile
    from specdec.cli.main import main

    built = []                    # what was started (not compiled here: the spec and the head are the point)
    monkeypatch.setattr(profile, "TargetModel", lambda spec: built.append(spec))
    monkeypatch.setattr(profile, "load_eagle_drafter", lambda head_dir, target_dir, **kw: built.append((head_dir, kw)))
    out = tmp_path / "startup.json"
    assert main(["bench", "profile", "--target", str(family3["target"]), "--eagle", str(family3[head]),
                 "--threads", "1", "--compile", "on", "--startup-only", "--json", str(out)]) == 0
    spec, (head_dir, kw) = built
    assert spec.compile == "on" and spec.compile_layers is layers
    assert head_dir == str(family3[head]) and kw["compile"] == "on"
    assert json.loads(out.read_text())["feature_layers"] is layers
    assert ("feature layers (EAGLE-3 head)" in capsys.readouterr().out) is layers
