"""Batched compiled verification (``specdec.compile.batched``): several
sessions' rows in one compiled forward whose batch dimension is free.
Batches the batched graphs serve take one forward, and every session gets
exactly what it gets verified alone on the eager target (accepted nodes,
tokens, features; EAGLE-3 sessions' feature layers too; a windowed,
soft-capped family too); batches they do not serve run row by row on the one-session graphs, never as one eager forward;
a failed check turns them off with one log line; a batching verifier service
builds them before readiness and opens them while idle."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import torch
from families import BY_NAME

from specdec.compile import batched, fixed_kv, forwards, startup
from specdec.local import DrafterChoice, build_local
from specdec.model import kv
from specdec.model.loading import ModelSpec
from specdec.request.params import SamplingParams
from specdec.tree.build import tree_from_lists
from verifier.engine import TargetModel, VerifierEngine
from verifier.service import VerifierService, VerifierServiceConfig

PROMPTS = [[5, 6, 7], [20, 21, 22, 20, 21, 22, 23, 9, 9], [3] * 17]


def _engines(path: str, captures: bool = True) -> tuple[VerifierEngine, VerifierEngine]:
    """(eager engine, compiled engine with batched graphs, capturing ones too with ``captures``)
    over one model; without ``captures`` only the one-session graphs these tests use are built."""
    eager = VerifierEngine(TargetModel(ModelSpec(path)))
    fast = VerifierEngine(TargetModel(ModelSpec(path), model=eager.target.model))
    if captures:
        fast.target.compiled = startup.compile_target(fast.target.lm, "on")
    else:
        fast.target.compiled = forwards.CompiledForward(fast.target.lm)
        assert startup.check_compiled(fast.target.compiled) is None
        fast.target.compiled.warm(forwards.READY_WIDTHS, (forwards.MIN_CAPACITY,))
    assert fast.target.compiled is not None
    if captures:
        assert startup.compile_captures(fast.target.compiled, widths=(1, 16))
    assert fast.target.compile_batches()
    assert set(fast.target.compiled.batched) == ({False, True} if captures else {False})
    return eager, fast


@pytest.fixture(scope="module")
def engines(tiny_family):
    return _engines(str(tiny_family["target"]))


@pytest.fixture
def rows_seen(engines, monkeypatch):
    """The row counts of the verify forwards run (-1: one ran eagerly); an eager batch fails the test."""
    forward = engines[1].target.compiled
    seen, run = [], forward.run

    def counting(cache, tokens, positions, mask, *args, **kwargs):
        out = run(cache, tokens, positions, mask, *args, **kwargs)
        if mask is not None or tokens.shape[1] == 1:                 # not a prefill
            seen.append(tokens.shape[0] if out is not None else -1)
        return out

    def counting_placed(cache, placed, *args, **kwargs):          # a one-session tree placed on the device
        out = run_placed(cache, placed, *args, **kwargs)
        seen.append(placed.tokens.shape[0])
        return out

    def no_eager_batch(*args, **kwargs):
        raise AssertionError("a batch ran as one eager forward")

    run_placed = forward.run_placed
    monkeypatch.setattr(forward, "run", counting)
    monkeypatch.setattr(forward, "run_placed", counting_placed)
    monkeypatch.setattr(kv, "gather_rows", no_eager_batch)
    return seen


def _tree(root: int, size: int, seed: int):
    """A tree of ``size`` nodes under ``root``: a chain and side branches, random tokens."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [root] + torch.randint(1, 60, (size - 1,), generator=gen).tolist()
    parents = [-1] + [i - 1 if i % 3 else max(0, i - 2) for i in range(1, size)]
    return tree_from_lists(tokens, parents)


def _run_both(engines, sizes, layers=(), cycles=6):
    """Each cycle: every session's tree verified in one batch on the compiled
    engine and alone on the eager one; both answers compared."""
    eager, fast = engines
    sids = [f"b{i}-{'-'.join(map(str, sizes))}-{len(layers)}" for i in range(len(PROMPTS))]
    for sid, prompt in zip(sids, PROMPTS):
        want = eager.prefill(sid, prompt, SamplingParams(), 40, feature_layers=layers)
        got = fast.prefill(sid, prompt, SamplingParams(), 40, feature_layers=layers)
        assert got.token == want.token
    try:
        for cycle in range(cycles):
            trees = [_tree(eager.committed_tokens(sid)[-1], sizes[(cycle + i) % len(sizes)], 10 * cycle + i)
                     for i, sid in enumerate(sids)]
            results = fast.verify_batch(list(zip(sids, trees)))
            for sid, tree, got in zip(sids, trees, results):
                assert not isinstance(got, Exception), got
                want = eager.verify(sid, tree)
                assert (got.accepted, got.tokens) == (want.accepted, want.tokens)
                torch.testing.assert_close(got.features, want.features, rtol=1e-4, atol=1e-4)
        for sid in sids:
            assert fast.committed_tokens(sid) == eager.committed_tokens(sid)
    finally:
        for sid in sids:
            eager.release(sid)
            fast.release(sid)


@pytest.mark.parametrize("sizes", [(1,), (16, 9, 12)], ids=["root-only", "trees"])
def test_a_batch_the_batched_graphs_serve_is_one_forward_and_each_session_gets_what_it_gets_alone(
        engines, rows_seen, sizes):
    _run_both(engines, sizes)
    assert rows_seen and set(rows_seen) == {len(PROMPTS)}          # every verify: one forward of all rows


def test_eagle3_sessions_feature_layers_come_from_the_batched_capturing_graphs(engines, rows_seen):
    layers = (0, engines[0].target.num_layers // 2, engines[0].target.num_layers - 1)
    _run_both(engines, (16, 1), layers)
    assert rows_seen and set(rows_seen) == {len(PROMPTS)}


def test_a_batch_no_batched_graph_serves_runs_row_by_row_on_the_compiled_graphs(engines, rows_seen):
    _run_both(engines, (5, 3), cycles=3)                               # widths 8 and 4: no batched graph
    assert rows_seen and set(rows_seen) == {1}


# gemma2's batched packages: ~2 min on an empty compile cache, with `make bench` (a non-Llama layout's
# compiled path stays in the suite: test_compiled.py, qwen3)
@pytest.mark.slow
def test_a_windowed_soft_capped_family_batches_on_the_batched_graphs(family_dir, monkeypatch):
    """gemma2: per-layer-type masks (sliding and full), soft-capped attention and logits."""
    both = _engines(str(family_dir(BY_NAME["gemma2"])), captures=False)
    seen = []
    run = both[1].target.compiled.run
    monkeypatch.setattr(both[1].target.compiled, "run",
                        lambda cache, tokens, *a: seen.append(tokens.shape[0]) or run(cache, tokens, *a))
    _run_both(both, (1, 16, 12), cycles=8)
    assert len(PROMPTS) in seen


def test_a_failed_check_turns_the_batched_graphs_off_with_one_line(tiny_family, monkeypatch, caplog):
    forward = forwards.CompiledForward(TargetModel(ModelSpec(str(tiny_family["target"]))).lm)
    monkeypatch.setattr(batched, "check_batched", lambda *args: "batched logits differ (test)")
    with caplog.at_level(logging.WARNING, logger="specdec.compile.batched"):
        assert not batched.compile_batches(forward)
    assert forward.batched == {} and not forward.serves_batch([3, 4], 1)
    lines = [r.getMessage() for r in caplog.records if r.name == "specdec.compile.batched"]
    assert len(lines) == 1 and "batched logits differ (test)" in lines[0] and "row by row" in lines[0]


def test_a_batching_verifier_service_builds_them_before_readiness_and_opens_them_while_idle(tiny_family, ahead_all):
    path = str(tiny_family["target"])

    async def main():
        stack = build_local(ModelSpec(path, compile="on"), DrafterChoice("eagle", str(tiny_family["eagle"])))
        forward = stack.verifier.target.compiled
        service = VerifierService(VerifierServiceConfig(batch_window_ms=2.0))
        await service.load(lambda: stack.verifier)
        try:
            built = set(forward.batched)
            queued = {(w, c) for w, c, _, batched in forward.due if batched}
            opened = forward.batched[False].graphs
            deadline = time.monotonic() + 300      # (a bound for a failure: the graphs open within a second)
            # open_next takes a graph off ``due`` before opening it: wait for the graphs, not for ``due``
            while (forward.due or not queued <= set(opened)) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return built, queued, opened, len(forward.due)
        finally:
            await service.aclose()

    built, queued, opened, left = asyncio.run(main())
    everything = {(w, c) for w in forwards.READY_WIDTHS for c in forwards.PACKAGED_CAPACITIES}
    assert built == {False}                       # no capturing graphs on this verifier: none batched
    assert queued == everything - {(1, forwards.MIN_CAPACITY)}      # the check opened that one
    assert everything <= set(opened) and left == 0


def test_batch_buffers_are_kept_for_the_latest_shapes_only(engines):
    forward = engines[1].target.compiled
    forward.spare.clear()
    for rows in range(2, 3 + forwards.SPARE_BATCHES):
        with torch.inference_mode():
            forward.reuse(fixed_kv.stacked_cache(forward.lm.new_cache(), forward.new_stack(forwards.MIN_CAPACITY, rows)))
    assert list(forward.spare) == [(rows, forwards.MIN_CAPACITY) for rows in range(3, 3 + forwards.SPARE_BATCHES)]


@pytest.mark.parametrize("sizes, graphs", [((16, 9, 12), "batched"), ((5, 3), "rows")], ids=["batched", "rows"])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9,
                                                                     repetition_penalty=1.2, seed=4)],
                         ids=["greedy", "penalised"])
def test_a_batch_step_reads_back_once_whatever_its_size(engines, rows_seen, sizes, graphs, params):
    """A batch step costs what one session's verify does (``specdec bench
    profile --cycle``'s counts): the trees go up in one copy and every row's
    verdict comes back in one read, on the batched graphs and row by row."""
    from specdec.bench.cycle_profile import Tally, counting

    _, fast = engines
    sids = [f"sync-{graphs}-{params.greedy}-{i}" for i in range(len(PROMPTS))]
    for sid, prompt in zip(sids, PROMPTS):
        fast.prefill(sid, prompt, params, 40)
    try:
        for cycle in range(3):
            trees = [_tree(fast.committed_tokens(sid)[-1], sizes[(cycle + i) % len(sizes)], 10 * cycle + i)
                     for i, sid in enumerate(sids)]
            tally = Tally()
            with counting(tally):
                results = fast.verify_batch(list(zip(sids, trees)))
            assert not any(isinstance(r, Exception) for r in results), results
            kinds = tally.phases["loop"].kinds
            assert (kinds["reads"], kinds["uploads"], kinds["shaped"]) == (1, 1, 0), tally.phases["loop"].sites
    finally:
        for sid in sids:
            fast.release(sid)
    assert set(rows_seen) == ({len(PROMPTS)} if graphs == "batched" else {1})
