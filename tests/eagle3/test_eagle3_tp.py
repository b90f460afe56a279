"""EAGLE-3 over a tensor-parallel verifier (`specdec verifier serve --tp 2`):
the ranks' shards all-reduce the residual stream, so the layers an EAGLE-3
head reads come back whole — equal to a single-process verifier's — and a
generation drafted by an EAGLE-3 drafter over the TP verifier is plain
greedy decoding."""

import asyncio
import json
import os
import subprocess
import sys
import time

import grpc
import pytest
import torch

from drafter.eagle.eagle3 import Eagle3Drafter
from eagle3_family import add_eagle3_drafter
from running_stack import Stack, start_orchestrator
from specdec.client import SpecdecClient
from specdec.model.loading import ModelSpec
from specdec.request import wire
from specdec.request.params import SamplingParams
from specdec.serving import tensor_wire
from specdec.tree.build import tree_from_lists
from specdec.v1 import verifier_pb2, verifier_pb2_grpc
from verifier.engine import TargetModel, VerifierEngine

PROMPT_IDS = [5, 17, 42, 8, 23, 11]
PROMPT = "def add(a, b):"
N = 24


@pytest.fixture(scope="module")
def tp_verifier(family3, tmp_path_factory):
    ready = tmp_path_factory.mktemp("tp3") / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli.main", "verifier", "serve", "--target",
                             str(family3["target"]), "--port", "0", "--metrics-port", "off", "--tp", "2",
                             "--ready-file", str(ready), "--drain-s", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.time() + 120
    while not ready.exists():
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read().decode()[-2000:])
        assert time.time() < deadline, "the TP verifier did not become ready"
        time.sleep(0.2)
    yield f"127.0.0.1:{json.loads(ready.read_text())['port']}"
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def features_over_grpc(address: str, layers: list[int]) -> list[torch.Tensor]:
    """The features a prefill and three one-node verifies return at ``layers``."""
    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            first = await stub.Prefill(verifier_pb2.VerifierPrefillRequest(
                session_id="tp3", prompt_ids=PROMPT_IDS, sampling=wire.sampling_to_proto(SamplingParams()),
                max_new_tokens=8, return_features=True, feature_layers=layers))
            out, token = [tensor_wire.tensor_from_proto(first.features)], first.token
            for _ in range(3):
                tree = tensor_wire.tree_to_proto(tree_from_lists([token], [-1]))
                res = await stub.Verify(verifier_pb2.VerifyRequest(session_id="tp3", tree=tree, return_features=True))
                out.append(tensor_wire.tensor_from_proto(res.features))
                token = res.tokens[-1]
            await stub.Release(verifier_pb2.VerifierReleaseRequest(session_id="tp3"))
            return out
    return asyncio.run(main())


def features_in_process(family3, layers: list[int]) -> list[torch.Tensor]:
    engine = VerifierEngine(TargetModel(ModelSpec(str(family3["target"]))))
    first = engine.prefill("one", PROMPT_IDS, SamplingParams(), 8, feature_layers=tuple(layers))
    out, token = [first.features], first.token
    for _ in range(3):
        res = engine.verify("one", tree_from_lists([token], [-1]))
        out.append(res.features)
        token = res.tokens[-1]
    engine.release("one")
    return out


def test_tp_verifier_returns_the_head_layers_whole(family3, tp_verifier):
    drafter = Eagle3Drafter(family3["eagle3"], family3["target"])
    layers = list(drafter.feature_layers)
    got, want = features_over_grpc(tp_verifier, layers), features_in_process(family3, layers)
    assert [tuple(g.shape) for g in got] == [tuple(w.shape) for w in want]
    assert tuple(got[0].shape) == (len(PROMPT_IDS), drafter.feature_size)
    for g, w in zip(got, want):
        assert torch.allclose(g, w.float(), atol=1e-4), (g - w).abs().max()


@pytest.mark.timeout(180)
def test_eagle3_generation_over_a_tp_verifier_is_plain_decoding(family3, tp_verifier):
    stack = Stack(family3)
    try:
        reference = stack.plain_output(PROMPT, N)
        add_eagle3_drafter(stack, "d3")
        stack.servers["o"] = stack.loop.run(start_orchestrator(tp_verifier, stack.address("d3"),
                                                               stack.paths["target"]))
        with SpecdecClient(stack.address("o"), timeout=60) as client:
            done = client.complete(PROMPT, max_new_tokens=N, method="eagle2")
        assert done.token_ids == reference
        assert done.stats.draft_tokens > 0 and done.stats.cycles < N
        assert stack.wait_sessions_closed("d3") == {"d3": 0}
    finally:
        stack.close()
