"""`specdec verifier serve --tp 2` and batching, through gRPC."""

import asyncio
import json
import os
import subprocess
import sys
import time

import grpc
import pytest

from specdec.local import DrafterChoice, build_local, generate
from specdec.model.loading import ModelSpec
from specdec.request import wire
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams
from specdec.serving import tensor_wire
from specdec.tree.build import tree_from_lists
from specdec.v1 import verifier_pb2, verifier_pb2_grpc

PROMPTS = [[5, 6, 7, 8], [20, 21, 22, 20, 21], [3] * 6]
NEW = 20


def greedy_over_grpc(addr: str, prompts, prefix="s", computes: dict | None = None) -> list[list[int]]:
    """Each prompt's greedy tokens, the sessions concurrent; ``computes``, if
    given, gets each session's verify ``compute_s``, in order."""
    async def one(stub, i, p):
        sid = f"{prefix}{i}"
        first = await stub.Prefill(verifier_pb2.VerifierPrefillRequest(
            session_id=sid, prompt_ids=p, sampling=wire.sampling_to_proto(SamplingParams()), max_new_tokens=NEW))
        toks = [first.token]
        while len(toks) < NEW:
            tree = tensor_wire.tree_to_proto(tree_from_lists([toks[-1]], [-1]))
            res = await stub.Verify(verifier_pb2.VerifyRequest(session_id=sid, tree=tree))
            toks.extend(res.tokens)
            if computes is not None:
                computes.setdefault(sid, []).append(res.compute_s)
        await stub.Release(verifier_pb2.VerifierReleaseRequest(session_id=sid))
        return toks[:NEW]

    async def main():
        async with grpc.aio.insecure_channel(addr) as ch:
            stub = verifier_pb2_grpc.VerifierServiceStub(ch)
            return await asyncio.gather(*(one(stub, i, p) for i, p in enumerate(prompts)))

    return asyncio.run(main())


@pytest.fixture(scope="module")
def reference(tiny_family):
    stack = build_local(ModelSpec(str(tiny_family["target"])), DrafterChoice("none"))
    stop = StopCriteria(max_new_tokens=NEW)
    return [generate(stack.verifier, None, p, SamplingParams(), stop, None).tokens for p in PROMPTS]


def serve(tiny_family, tmp_path, *extra):
    ready = tmp_path / "ready.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli.main", "verifier", "serve", "--target",
                             str(tiny_family["target"]), "--port", "0", "--metrics-port", "off",
                             "--ready-file", str(ready), "--drain-s", "1", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.time() + 120
    while not ready.exists():
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read().decode()[-2000:])
        if time.time() > deadline:
            proc.kill()
            raise AssertionError("verifier did not become ready")
        time.sleep(0.2)
    time.sleep(0.1)
    return proc, f"127.0.0.1:{json.loads(ready.read_text())['port']}"


def stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_tp2_server_matches_single_process(tiny_family, tmp_path, reference):
    proc, addr = serve(tiny_family, tmp_path, "--tp", "2")
    try:
        assert greedy_over_grpc(addr, PROMPTS) == reference
    finally:
        stop(proc)


def batches(computes: dict[str, list[float]]) -> list[int]:
    """The sizes of the batches the verifies ran in, as their ``compute_s``
    tell: a batched verify answers each of its calls with the seconds of the
    one forward they shared, a verify run alone its own (float timings that
    never coincide)."""
    calls: dict[float, int] = {}
    for seconds in computes.values():
        for s in seconds:
            calls[s] = calls.get(s, 0) + 1
    return sorted(calls.values(), reverse=True)


def test_batched_server_concurrent_sessions_match(tiny_family, tmp_path, reference):
    proc, addr = serve(tiny_family, tmp_path, "--batch-window-ms", "20")
    computes: dict[str, list[float]] = {}
    try:
        assert greedy_over_grpc(addr, PROMPTS, computes=computes) == reference
    finally:
        stop(proc)
    assert sorted(computes) == ["s0", "s1", "s2"] and all(len(c) == NEW - 1 for c in computes.values())
    assert all(len(set(c)) == len(c) for c in computes.values())     # one session's verifies: one per batch
    sizes = batches(computes)
    assert sizes[0] > 1, f"no two sessions' verifies ran as one batch: {sizes}"


def test_bad_tp_degree_is_one_line(tiny_family):
    proc = subprocess.run([sys.executable, "-m", "specdec.cli.main", "verifier", "serve", "--target",
                           str(tiny_family["target"]), "--tp", "3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "must divide the target's attention heads" in proc.stderr.strip().splitlines()[-1]
