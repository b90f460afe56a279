"""A compiled target opens a root-only cycle's and a default tree's graphs
before readiness and leaves the rest of its packaged graphs (the other
widths, the capacity past the first) to ``CompiledForward.open_next``, which
the verifier service calls on its worker thread while no request is in
flight (opening a package holds the GIL): a session then passes 256 slots
without stalling on them. Each graph opens once whichever thread asks
first, a failure leaves the rest to first use with one log line, and graphs
nobody opened still open on first use with the eager logits."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import torch

from specdec.compile.eager import eager_forward, eager_run
from specdec.compile import aot, forwards
from specdec.local import DrafterChoice, build_local
from specdec.model.loading import AHEAD_ENV, ModelSpec
from specdec.model.masks import causal_allowed
from specdec.v1 import verifier_pb2
from verifier.engine import TargetModel
from verifier.service import VerifierService, VerifierServiceConfig

FIRST, LARGER = forwards.PACKAGED_CAPACITIES
READY = {(w, FIRST) for w in forwards.READY_WIDTHS}
LATER = {(w, c) for w in forwards.STARTUP_WIDTHS for c in (FIRST, LARGER)} - READY   # the check runs READY's
LATER |= {(forwards.PREFILL_WIDTH, c) for c in forwards.PREFILL_CAPACITIES}


def test_only_what_a_first_request_needs_opens_at_start_up_and_open_next_opens_the_rest(tiny_family, ahead_all):
    target = TargetModel(ModelSpec(str(tiny_family["target"]), compile="on"))
    graphs = target.compiled.steps.graphs
    assert READY <= set(graphs) and not LATER & set(graphs)
    assert {(w, c) for w, c, captures, batched in target.compiled.due} == LATER
    while target.compiled.open_next():
        pass
    assert LATER <= set(graphs) and not target.compiled.due


def test_ahead_ready_builds_only_the_ready_graphs_and_the_rest_on_first_use(tiny_family, monkeypatch, tmp_path):
    """``SPECDEC_COMPILE_AHEAD=ready`` on an empty cache: start-up builds only
    the graphs it opens, leaves nothing due, and a forward at another width
    builds its package then and gives the eager logits."""
    monkeypatch.setenv(AHEAD_ENV, "ready")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    target = TargetModel(ModelSpec(str(tiny_family["target"]), compile="on"))
    packages = target.compiled.steps.packages
    assert packages.is_relative_to(tmp_path)
    built = {p.name for p in packages.iterdir() if p.suffix in (".so", ".pt2")}
    assert built == {aot.package_path(packages, w, c, False).with_suffix(".so").name for w, c in READY}
    assert not target.compiled.due
    ids, pos = torch.tensor([[3, 5, 7, 9]]), torch.arange(4)[None]     # 4 nodes: a width start-up did not build
    mask = target.lm.masks(causal_allowed(4, 0)[None], pos, pos)
    with torch.inference_mode():
        got = target.compiled.run(target.compiled.new_cache(), ids, pos, mask)
        want = eager_run(target.lm, target.lm.new_cache(8), ids, pos, mask)
    assert torch.allclose(got[2], want[2], atol=1e-4)
    assert aot.package_built(aot.package_path(packages, 4, FIRST, False))


def test_the_verifier_service_opens_them_while_idle_and_not_beside_a_session(tiny_family, ahead_all):
    path = str(tiny_family["target"])

    async def main():
        stack = build_local(ModelSpec(path, compile="on"), DrafterChoice("eagle", str(tiny_family["eagle"])))
        forward = stack.verifier.target.compiled
        left = len(forward.due)
        service = VerifierService(VerifierServiceConfig())
        await service.load(lambda: stack.verifier)
        service.lifecycle.ready = True
        try:
            # a session opened at once: nothing opens while it lives
            await service.Prefill(verifier_pb2.VerifierPrefillRequest(session_id="s", prompt_ids=[3, 4, 5],
                                                                      max_new_tokens=4), None)
            await asyncio.sleep(0.5)
            during = len(forward.due)
            await service.Release(verifier_pb2.VerifierReleaseRequest(session_id="s"), None)
            deadline = time.monotonic() + 120
            while forward.due and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return left, during, len(forward.due)
        finally:
            await service.aclose()

    left, during, after = asyncio.run(main())
    assert left > 0 and after == 0
    assert during >= left - 1           # at most the one it had started before the session came


def test_a_graph_is_opened_once_whichever_thread_asks_first(tiny_family, monkeypatch):
    target = TargetModel(ModelSpec(str(tiny_family["target"])))
    graphs = forwards.FixedGraphs(forwards.FixedStep(target.lm), target.lm.model, target.lm.dtype,
                                  torch.device("cpu"))
    opened = []

    def slow_open(*args):
        opened.append(args)
        time.sleep(0.2)             # long enough for the other thread to ask meanwhile
        return object()

    monkeypatch.setattr(aot, "load_or_build", slow_open)
    got = []
    threads = [threading.Thread(target=lambda: got.append(graphs.get(1, LARGER, lambda: ()))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(opened) == 1 and len(got) == 2 and got[0] is got[1]


def test_a_failure_opening_them_leaves_the_rest_to_first_use_with_one_line(tiny_family, monkeypatch, caplog):
    path = str(tiny_family["target"])
    eager = TargetModel(ModelSpec(path))
    forward = forwards.CompiledForward(eager.lm)
    forward.warm((1,))
    assert (1, LARGER, False, False) in forward.due

    def broken(*args):
        raise RuntimeError("disk gone")

    async def main():
        service = VerifierService(VerifierServiceConfig())
        service.sessions = {}               # loaded, no session open: idle
        try:
            service.start_when_idle(forward.open_next, every_s=0.01)
            await asyncio.wait_for(service._idle_work, 30)
        finally:
            await service.aclose()

    monkeypatch.setattr(forward, "_first_run", broken)
    with caplog.at_level(logging.WARNING, logger="specdec.serving.server"):
        asyncio.run(main())
    lines = [r for r in caplog.records if r.name == "specdec.serving.server"]
    assert len(lines) == 1 and "first use" in lines[0].getMessage() and "disk gone" in lines[0].error
    assert (1, LARGER) not in forward.steps.graphs
    prompt = torch.tensor([[(3 * i) % 50 + 1 for i in range(forwards.MIN_CAPACITY)]])
    positions = torch.arange(prompt.shape[1])[None]
    with torch.inference_mode():              # a session past the first capacity opens it on first use
        cache, eager_cache = forward.new_cache(), eager.lm.new_cache()
        for c in (cache, eager_cache):
            eager_forward(eager.lm, c, prompt, positions, None)
        forward.fit(cache, 1)
        got = forward.forward(cache, torch.tensor([[7]]), torch.tensor([[prompt.shape[1]]]), None)
        want = eager_forward(eager.lm, eager_cache, torch.tensor([[7]]), torch.tensor([[prompt.shape[1]]]),
                                      None)
    assert got is not None and (1, LARGER) in forward.steps.graphs
    assert torch.allclose(got[1], want[1], atol=1e-4)


def test_trees_past_the_start_up_widths_are_built_and_opened_before_any_request(tiny_family, ahead_all):
    target = TargetModel(ModelSpec(str(tiny_family["target"]), compile="on"))
    graphs = target.compiled.steps.graphs
    target.compile_trees(16)                                # the start-up widths serve it: nothing to do
    assert not {w for w, _ in graphs} - set(forwards.STARTUP_WIDTHS) - {forwards.PREFILL_WIDTH}
    target.compile_trees(20)                                # a 20-node tree runs at width 32
    assert {(32, c) for c in forwards.PACKAGED_CAPACITIES} <= set(graphs) and not target.compiled.due
    assert (64, LARGER) not in graphs                       # nor wider (width 64 at 256 slots: prefill's)
    eager = TargetModel(ModelSpec(str(tiny_family["target"])))
    eager.compile_trees(64)                                 # eager forwards: a no-op
    assert eager.compiled is None


def test_a_server_never_builds_a_graph_on_a_request_and_verifies_that_tree_eagerly(tiny_family, monkeypatch,
                                                                                    caplog):
    from specdec.compile.fixed_graphs import FixedGraphs
    from specdec.request.params import SamplingParams
    from specdec.tree.build import tree_from_lists
    from verifier.engine import VerifierEngine

    target = TargetModel(ModelSpec(str(tiny_family["target"]), compile="on"))
    target.unbuilt_eager(16)                                # a verifier serving the default tree
    assert not target.compiled.build_on_use
    on_disk = FixedGraphs.ready
    monkeypatch.setattr(FixedGraphs, "ready", lambda self, w, c: w != 32 and on_disk(self, w, c))  # no 32-wide

    def no_build(*args):
        raise AssertionError("a request built a package")

    monkeypatch.setattr(aot, "build_package", no_build)
    engines = [VerifierEngine(target), VerifierEngine(TargetModel(ModelSpec(str(tiny_family["target"]))))]
    prompt = [5, 9, 2, 7, 11, 3]
    firsts = {e.prefill("s", prompt, SamplingParams(), 8).token for e in engines}
    assert len(firsts) == 1
    root = firsts.pop()
    parents = [-1] + [i // 2 for i in range(19)]             # 20 nodes: width 32
    tokens = [root] + [(7 * i + 3) % 50 for i in range(19)]
    with caplog.at_level(logging.WARNING, logger="specdec.compile.forwards"):
        results = [e.verify("s", tree_from_lists(tokens, parents)) for e in engines]
        again = [e.verify("s", tree_from_lists([r.tokens[-1]] + tokens[1:], parents))
                 for e, r in zip(engines, results)]
    assert results[0].tokens == results[1].tokens and again[0].tokens == again[1].tokens
    assert (32, FIRST) not in target.compiled.steps.graphs
    lines = [r.getMessage() for r in caplog.records if r.name == "specdec.compile.forwards"]
    assert len(lines) == 1 and "32-wide" in lines[0] and "--compile-tree-tokens" in lines[0]
    assert target.compiled.run(target.compiled.new_cache(), torch.tensor([[1]]), torch.tensor([[0]]),
                               None) is not None        # a built width still runs compiled
