"""Compiled prefill (``CompiledForward.prefill``): a prompt runs in chunks of
``PREFILL_WIDTH`` tokens through the compiled graphs and gives the eager
forward's features, logits and feature-layer streams; a prompt past the
prefill capacities runs eagerly in the next capacity bucket (the session
stays on the compiled path); a chunk whose graph is neither open nor on disk runs eagerly
(nothing is compiled on a request); a prefill leaves the cache as an eager
one would, so the next steps stay on the compiled path."""

from __future__ import annotations

import pytest
import torch

from specdec.compile import forwards, startup
from specdec.model import kv
from specdec.model.loading import AHEAD_ENV, ModelSpec
from verifier.engine import TargetModel


@pytest.fixture(scope="module")
def targets(tiny_family):
    return compiled_targets(tiny_family)


def compiled_targets(tiny_family):
    """The tiny target compiled as a verifier for an EAGLE-3 head starts it, with
    what a prompt's chunks take built now as start-up builds them (the
    capturing graphs at the start-up widths and the prefill chunk's, at the
    prefill capacity; building every capacity of both sets, as a server does
    by default, adds minutes on an empty compile cache and nothing here)."""
    path = str(tiny_family["target"])
    eager = TargetModel(ModelSpec(path))
    fast = TargetModel(ModelSpec(path), model=eager.model)
    fast.compiled = startup.compile_target(fast.lm, "on", captures=True)
    assert fast.compiled is not None and fast.compiled.capturing is not None
    with pytest.MonkeyPatch.context() as env:
        env.setenv(AHEAD_ENV, "all")
        widths = (*forwards.STARTUP_WIDTHS, forwards.PREFILL_WIDTH)
        fast.compiled.warm(widths, forwards.PREFILL_CAPACITIES, captures=True)
    return eager, fast


def _prompt(n: int, vocab: int) -> torch.Tensor:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(n))


@pytest.mark.parametrize("n", [2, 17, 64, 150, 300], ids=lambda n: f"{n}-tokens")
def test_a_prompt_in_compiled_chunks_gives_the_eager_outputs(targets, monkeypatch, n):
    eager, fast = targets
    layers = (0, eager.num_layers - 1)
    ids = _prompt(n, eager.vocab_size)
    steps, step = [], fast.compiled._step
    monkeypatch.setattr(fast.compiled, "_step", lambda *a, **k: steps.append(a[5]) or step(*a, **k))
    want_cache, got_cache = eager.new_cache(n), fast.new_cache(n)
    want = eager.run(want_cache, ids[None], torch.arange(n)[None], None, layers)
    got = fast.run(got_cache, ids[None], torch.arange(n)[None], None, layers)
    for name, w, g in zip(("features", "streams", "logits"), want, got):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=name)
    assert kv.seq_len(got_cache) == n and fast.compiled.accepts(got_cache, 1)
    for w, g in zip(want_cache.layers, got_cache.layers):
        torch.testing.assert_close(g.keys, w.keys, rtol=1e-4, atol=1e-4)
    if n <= forwards.MIN_CAPACITY:
        assert len(steps) == -(-n // forwards.PREFILL_WIDTH)            # every chunk compiled
        assert set(steps) <= {*forwards.STARTUP_WIDTHS, forwards.PREFILL_WIDTH}
    else:                                           # past the prefill capacities: eager, in the next bucket
        assert steps == [] and got_cache.fixed_buffers.stack.shape[4] == forwards.capacity_bucket(n)


def test_a_chunk_with_no_graph_at_hand_runs_eagerly(targets):
    eager, fast = targets
    traced = forwards.CompiledForward(fast.lm, ahead_of_time=False)     # torch.compile graphs: none open yet
    ids = _prompt(40, eager.vocab_size)
    cache = traced.new_cache(40)
    got = traced.run(cache, ids[None], torch.arange(40)[None], None)
    want = eager.run(eager.new_cache(40), ids[None], torch.arange(40)[None], None)
    torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-4)
    assert traced.steps.graphs == {} and traced.steps.traced is None     # nothing compiled on the request
    assert kv.seq_len(cache) == 40 and traced.accepts(cache, 1)
