"""A compiled target opens a root-only cycle's and a default tree's graphs
before readiness and the rest of its packaged graphs (the other widths, the
capacity past the first) on a background thread as its first session opens
(``CompiledForward.session_opened``), so the first session to pass 256 slots
does not stall on opening them: each graph opens once whichever thread asks
first, a failure there leaves them to open on first use with one log line,
and a process exiting while they open exits cleanly."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import torch

from specdec import compiled
from specdec.models import ModelSpec
from verifier.engine import TargetModel

LARGER = compiled.PACKAGED_CAPACITIES[1]


def test_graphs_past_the_first_capacity_open_in_the_background(tiny_family):
    target = TargetModel(ModelSpec(str(tiny_family["target"]), compile="on"))
    first = compiled.MIN_CAPACITY
    ready = {(w, first) for w in compiled.READY_WIDTHS}
    later = {(w, c) for w in compiled.STARTUP_WIDTHS for c in (first, LARGER)} - ready - {(4, first)}
    assert target.compiled.opener is None           # start-up opens only what the first requests need
    assert ready <= set(target.compiled.steps.graphs) and not later & set(target.compiled.steps.graphs)
    target.new_cache()
    opener = target.compiled.opener
    opener.join(timeout=120)
    assert not opener.is_alive()
    assert later <= set(target.compiled.steps.graphs)


def test_a_graph_is_opened_once_whichever_thread_asks_first(tiny_family, monkeypatch):
    target = TargetModel(ModelSpec(str(tiny_family["target"])))
    graphs = compiled.FixedGraphs(compiled.FixedStep(target.lm), target.lm.model, target.lm.dtype,
                                  torch.device("cpu"))
    opened = []

    def slow_open(*args):
        opened.append(args)
        time.sleep(0.2)             # long enough for the other thread to ask meanwhile
        return object()

    monkeypatch.setattr(compiled.compiled_aot, "load_or_build", slow_open)
    got = []
    threads = [threading.Thread(target=lambda: got.append(graphs.get(1, LARGER, lambda: ()))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(opened) == 1 and len(got) == 2 and got[0] is got[1]


def test_a_failure_opening_ahead_leaves_the_graphs_to_first_use_with_one_line(tiny_family, monkeypatch, caplog):
    path = str(tiny_family["target"])
    eager = TargetModel(ModelSpec(path))
    forward = compiled.CompiledForward(eager.lm)
    forward.warm((1,))
    forward.due.clear()                       # what warm left to open: this test's own below

    def broken(*args):
        raise RuntimeError("disk gone")

    monkeypatch.setattr(forward, "_first_run", broken)
    with caplog.at_level(logging.WARNING, logger="specdec.compiled"):
        forward.due.append((1, LARGER, False))
        forward.session_opened()
        forward.opener.join(timeout=60)
    lines = [r.getMessage() for r in caplog.records if r.name == "specdec.compiled"]
    assert len(lines) == 1 and "RuntimeError: disk gone" in lines[0] and "first use" in lines[0]
    assert (1, LARGER) not in forward.steps.graphs
    prompt = torch.tensor([[(3 * i) % 50 + 1 for i in range(compiled.MIN_CAPACITY)]])
    positions = torch.arange(prompt.shape[1])[None]
    with torch.inference_mode():              # a session past the first capacity opens it on first use
        cache, eager_cache = forward.new_cache(), eager.lm.new_cache()
        for c in (cache, eager_cache):
            compiled.eager_forward(eager.lm, c, prompt, positions, None)
        forward.fit(cache, 1)
        got = forward.forward(cache, torch.tensor([[7]]), torch.tensor([[prompt.shape[1]]]), None)
        want = compiled.eager_forward(eager.lm, eager_cache, torch.tensor([[7]]), torch.tensor([[prompt.shape[1]]]),
                                      None)
    assert got is not None and (1, LARGER) in forward.steps.graphs
    assert torch.allclose(got[1], want[1], atol=1e-4)


def test_a_process_exiting_while_graphs_open_exits_cleanly(tiny_family):
    script = ("import sys; from specdec.models import ModelSpec; from verifier.engine import TargetModel; "
              "t = TargetModel(ModelSpec(sys.argv[1], compile='on')); t.new_cache(); "
              "print('opening' if t.compiled.opener.is_alive() else 'opened')")
    done = subprocess.run([sys.executable, "-c", script, str(tiny_family["target"])], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() in ("opening", "opened")
