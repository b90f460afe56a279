"""VerifierService over real gRPC: same results as the in-process engine, and
each error status without disturbing other sessions."""

import asyncio
import threading

import grpc
import pytest
import torch

from serving.helpers import channel_to, rpc_error, start_verifier
from specdec.request import wire
from specdec.request.params import SamplingParams
from specdec.request.params import TreeParams
from specdec.serving import tensor_wire
from specdec.serving.metrics import REGISTRY
from specdec.tree.build import tree_from_lists
from specdec.v1 import common_pb2
from specdec.v1.verifier_pb2 import (VerifierGetInfoRequest, VerifierPrefillRequest, VerifierReleaseRequest,
                                     VerifierRollbackRequest, VerifyRequest)
from specdec.v1.verifier_pb2_grpc import VerifierServiceStub
from trees import CutTo

pytestmark = pytest.mark.asyncio

PROMPT = [5, 17, 42, 8, 99, 23]
CODE = grpc.StatusCode


def greedy_continuation(engine, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding (root-only trees) on the in-process engine."""
    sid = "reference"
    out = [engine.prefill(sid, prompt, SamplingParams()).token]
    while len(out) < n:
        out += engine.verify(sid, tree_from_lists([out[-1]], [-1])).tokens
    engine.release(sid)
    return out


def two_hit_tree(root: int, right: list[int], vocab: int):
    """root -> {wrong, right[0] -> {right[1], wrong}}: accepts nodes 2, 3, a path
    that is not contiguous in the flattened order (the KV gather is exercised)."""
    wrong = [(t + 1) % vocab for t in right]
    return tree_from_lists([root, wrong[0], right[0], right[1], wrong[1]], [-1, 0, 0, 2, 2])


def prefill_request(sid, prompt=PROMPT, params=SamplingParams(), **kw):
    return VerifierPrefillRequest(session_id=sid, prompt_ids=prompt, sampling=wire.sampling_to_proto(params), **kw)


def verify_request(sid, tree, **kw):
    return VerifyRequest(session_id=sid, tree=tensor_wire.tree_to_proto(tree), **kw)


async def test_greedy_verify_matches_engine_and_plain_decoding(verifier, verifier_channel, local_verifier):
    _, servicer = verifier
    stub = VerifierServiceStub(verifier_channel)
    vocab = local_verifier.target.vocab_size
    cont = greedy_continuation(local_verifier, PROMPT, 12)

    local = local_verifier.prefill("g", PROMPT, SamplingParams())
    remote = await stub.Prefill(prefill_request("g", return_features=True))
    assert remote.token == local.token == cont[0]
    assert remote.compute_s > 0
    assert torch.equal(tensor_wire.tensor_from_proto(remote.features), local.features)

    done = 1
    while done + 3 <= len(cont):
        tree = two_hit_tree(cont[done - 1], cont[done:done + 2], vocab)
        want = local_verifier.verify("g", tree)
        got = await stub.Verify(verify_request("g", tree, return_features=True))
        assert list(got.accepted_nodes) == want.accepted == [2, 3]
        assert list(got.tokens) == want.tokens == cont[done:done + 3]
        assert torch.equal(tensor_wire.tensor_from_proto(got.features), want.features)
        done += 3
    assert servicer.engine.committed_tokens("g") == local_verifier.committed_tokens("g") == PROMPT + cont[:done]


async def test_sampled_verify_with_drafter_trees_matches_engine(verifier, verifier_channel, local_verifier,
                                                                 make_local_drafter):
    stub = VerifierServiceStub(verifier_channel)
    drafter = make_local_drafter("eagle")
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    cfg = TreeParams(total_tokens=8, depth=3, expand_k=2)
    local = local_verifier.prefill("s", PROMPT, params)
    remote = await stub.Prefill(prefill_request("s", params=params))
    assert remote.token == local.token and not remote.features.data    # none unless asked
    drafter.prefill("s", PROMPT + [local.token], local.features)
    for _ in range(5):
        tree = drafter.draft("s", cfg)
        want = local_verifier.verify("s", tree)
        got = await stub.Verify(verify_request("s", tree))
        assert (list(got.accepted_nodes), list(got.tokens)) == (want.accepted, want.tokens)
        drafter.commit("s", want.tokens, want.features)


async def test_float16_features(tiny_family, local_verifier):
    server, _ = await start_verifier(tiny_family, feature_dtype="float16", metrics_port=None)
    try:
        async with channel_to(server) as ch:
            got = await VerifierServiceStub(ch).Prefill(prefill_request("h", return_features=True))
        want = local_verifier.prefill("h", PROMPT, SamplingParams())
        assert got.features.dtype == "float16" and len(got.features.data) == 2 * want.features.numel()
        assert torch.equal(tensor_wire.tensor_from_proto(got.features), want.features.half())
    finally:
        await server.stop()


async def test_rollback_then_verify_matches_engine(verifier_channel, local_verifier):
    stub = VerifierServiceStub(verifier_channel)
    vocab = local_verifier.target.vocab_size
    cont = greedy_continuation(local_verifier, PROMPT, 8)
    local_verifier.prefill("r", PROMPT, SamplingParams())
    await stub.Prefill(prefill_request("r"))
    tree = two_hit_tree(cont[0], cont[1:3], vocab)
    local_verifier.verify("r", tree)
    await stub.Verify(verify_request("r", tree))
    keep = len(PROMPT) + 2                             # drop the last accepted token and the bonus
    local_verifier.rollback("r", keep)
    await stub.Rollback(VerifierRollbackRequest(session_id="r", length=keep))
    tree = tree_from_lists([cont[1], cont[2], 7], [-1, 0, 1])
    want = local_verifier.verify("r", tree)
    got = await stub.Verify(verify_request("r", tree))
    assert list(got.tokens) == want.tokens and want.tokens[0] == cont[2]
    err = await rpc_error(stub.Rollback(VerifierRollbackRequest(session_id="r", length=0)))
    assert err.code() == CODE.INVALID_ARGUMENT and "rollback length" in err.details()


async def test_malformed_requests_are_invalid_argument_naming_the_field(verifier_channel, local_verifier):
    stub = VerifierServiceStub(verifier_channel)
    first = (await stub.Prefill(prefill_request("ok"))).token
    local_verifier.prefill("ok", PROMPT, SamplingParams())
    bad_trees = {
        "tree.parents[3] = 5 is not in [0, 3)": common_pb2.DraftTree(tokens=[first, 1, 2, 3], parents=[-1, 0, 0, 5]),
        "tree.tokens[1] = 100000 is outside the vocabulary": common_pb2.DraftTree(tokens=[first, 100000],
                                                                                 parents=[-1, 0]),
        "tree.tree is empty": common_pb2.DraftTree(),
        "tree.values has 1 entries for 2 nodes": common_pb2.DraftTree(tokens=[first, 1], parents=[-1, 0],
                                                                       values=[0.0]),
        "tree.proposals: proposal of node 0: child token 2 has no probability in it": common_pb2.DraftTree(
            tokens=[first, 1, 2], parents=[-1, 0, 0],
            proposals=[common_pb2.Proposal(node=0, tokens=[1, 3], probs=[0.5, 0.5])]),
        "tree.proposals: proposal of node 1: the node has no children": common_pb2.DraftTree(
            tokens=[first, 1], parents=[-1, 0], proposals=[common_pb2.Proposal(node=1, tokens=[1], probs=[1.0])]),
        "tree.proposals[1]: node 0 has two proposals": common_pb2.DraftTree(
            tokens=[first, 1], parents=[-1, 0], proposals=[common_pb2.Proposal(node=0, tokens=[1], probs=[1.0])] * 2),
    }
    for words, tree in bad_trees.items():
        err = await rpc_error(stub.Verify(VerifyRequest(session_id="ok", tree=tree)))
        assert err.code() == CODE.INVALID_ARGUMENT and words in err.details(), err.details()
    bad_prefills = {
        "prompt_ids must not be empty": prefill_request("p1", prompt=[]),
        "max_new_tokens must be >= 0": prefill_request("p2", max_new_tokens=-1),
        "exceeds the model's context": prefill_request("p3", max_new_tokens=10_000),
        "sampling.temperature": VerifierPrefillRequest(session_id="p4", prompt_ids=PROMPT,
                                                       sampling=common_pb2.SamplingParams(temperature=-1)),
        "sampling.top_p": VerifierPrefillRequest(session_id="p5", prompt_ids=PROMPT,
                                                 sampling=common_pb2.SamplingParams(top_p=2.0)),
        "session_id must not be empty": prefill_request(""),
        "already exists": prefill_request("ok"),
        "outside the vocabulary": prefill_request("p6", prompt=[1, -4]),
        "sampling.logit_bias: token id 100000 is outside the vocabulary": prefill_request(
            "p7", params=SamplingParams(logit_bias={3: 1.0, 100000: -5.0})),
        "sampling.logit_bias[3] must be in [-100, 100]": prefill_request(
            "p8", params=SamplingParams(logit_bias={3: 150.0})),
        "prompt_logprobs must be an integer in [0, 20]": prefill_request("p9", prompt_logprobs=21),
    }
    for words, request in bad_prefills.items():
        err = await rpc_error(stub.Prefill(request))
        assert err.code() == CODE.INVALID_ARGUMENT and words in err.details(), err.details()
    # root mismatch: a precondition on the session's state, not a malformed message
    err = await rpc_error(stub.Verify(verify_request("ok", tree_from_lists([(first + 1) % 50], [-1]))))
    assert err.code() == CODE.FAILED_PRECONDITION and "root" in err.details()
    # the session is undisturbed by all of the above
    tree = tree_from_lists([first], [-1])
    assert list((await stub.Verify(verify_request("ok", tree))).tokens) == local_verifier.verify("ok", tree).tokens
    info = await stub.GetInfo(VerifierGetInfoRequest())
    assert info.active_sessions == 1


async def test_prefill_scores_the_prompt_with_its_own_forward(tiny_family, verifier_channel, local_verifier):
    """prompt_logprobs: log-softmax of one plain forward of the target over the
    prompt, at each position for the next prompt token, with the top-k."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_family["target"], dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, :-1].float(), dim=-1)   # [P - 1, V]
    stub = VerifierServiceStub(verifier_channel)
    got = await stub.Prefill(prefill_request("scored", prompt_logprobs=4, logprobs=1))
    assert [e.token for e in got.prompt_logprobs] == PROMPT[1:] and len(got.logprobs) == 1
    chosen = want.gather(-1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor([e.logprob for e in got.prompt_logprobs]), chosen, atol=1e-5)
    top_vals, top_idx = want.topk(4, dim=-1)
    assert [list(e.top_tokens) for e in got.prompt_logprobs] == top_idx.tolist()
    assert torch.allclose(torch.tensor([list(e.top_logprobs) for e in got.prompt_logprobs]), top_vals, atol=1e-5)
    plain = await stub.Prefill(prefill_request("unscored"))
    assert plain.token == got.token and not plain.prompt_logprobs
    one = await stub.Prefill(prefill_request("one", prompt=[7], prompt_logprobs=2))
    assert not one.prompt_logprobs                        # the first token has no logprob
    for sid in ("scored", "unscored", "one"):
        assert (await stub.Release(VerifierReleaseRequest(session_id=sid))).released


async def test_logit_bias_steers_greedy_verify_as_the_engine(verifier_channel, local_verifier):
    stub = VerifierServiceStub(verifier_channel)
    plain = greedy_continuation(local_verifier, PROMPT, 1)[0]
    params = SamplingParams(logit_bias={plain: -100.0})
    got = await stub.Prefill(prefill_request("biased", params=params))
    assert got.token == local_verifier.prefill("biased", PROMPT, params).token != plain
    tree = tree_from_lists([got.token], [-1])
    assert list((await stub.Verify(verify_request("biased", tree))).tokens) == \
        local_verifier.verify("biased", tree).tokens


async def test_unknown_session_is_not_found(verifier_channel):
    stub = VerifierServiceStub(verifier_channel)
    for call in (stub.Verify(verify_request("nope", tree_from_lists([1], [-1]))),
                 stub.Rollback(VerifierRollbackRequest(session_id="nope", length=1))):
        err = await rpc_error(call)
        assert err.code() == CODE.NOT_FOUND and "'nope' does not exist" in err.details()
    assert (await stub.Release(VerifierReleaseRequest(session_id="nope"))).released is False


async def test_idle_session_is_evicted_after_ttl(tiny_family):
    server, servicer = await start_verifier(tiny_family, session_ttl=0.3, metrics_port=None)
    evicted_before = REGISTRY.get_sample_value("specdec_sessions_evicted_total", {"role": "verifier"}) or 0
    try:
        async with channel_to(server) as ch:
            stub = VerifierServiceStub(ch)
            stale = (await stub.Prefill(prefill_request("stale"))).token
            live = (await stub.Prefill(prefill_request("live"))).token
            assert (await stub.GetInfo(VerifierGetInfoRequest())).active_sessions == 2
            for i in range(300):                       # "live" keeps being used, "stale" idles (0.8 s to 30 s)
                await asyncio.sleep(0.1)
                live = (await stub.Verify(verify_request("live", tree_from_lists([live], [-1])))).tokens[-1]
                if i >= 7 and "stale" not in servicer.sessions:
                    break
            # evicted by the background sweep, without any new Prefill to trigger it
            assert "stale" not in servicer.sessions and "live" in servicer.sessions
            err = await rpc_error(stub.Verify(verify_request("stale", tree_from_lists([stale], [-1]))))
            assert err.code() == CODE.NOT_FOUND and "evicted" in err.details()
            info = await stub.GetInfo(VerifierGetInfoRequest())
            assert info.active_sessions == 1 and info.kv_bytes == servicer.engine.kv_bytes() > 0
            assert REGISTRY.get_sample_value("specdec_sessions_evicted_total", {"role": "verifier"}) == evicted_before + 1
    finally:
        await server.stop()


async def test_session_cap_is_resource_exhausted(tiny_family):
    server, _ = await start_verifier(tiny_family, max_sessions=2, metrics_port=None)
    try:
        async with channel_to(server) as ch:
            stub = VerifierServiceStub(ch)
            a = (await stub.Prefill(prefill_request("a"))).token
            await stub.Prefill(prefill_request("b"))
            err = await rpc_error(stub.Prefill(prefill_request("c")))
            assert err.code() == CODE.RESOURCE_EXHAUSTED and "2 sessions" in err.details()
            assert (await stub.Release(VerifierReleaseRequest(session_id="b"))).released
            await stub.Prefill(prefill_request("c"))
            got = await stub.Verify(verify_request("a", tree_from_lists([a], [-1])))   # "a" is undisturbed
            assert len(got.tokens) == 1
            info = await stub.GetInfo(VerifierGetInfoRequest())
            assert (info.active_sessions, info.max_sessions) == (2, 2)
    finally:
        await server.stop()


async def test_kv_bytes_follow_sessions(verifier, verifier_channel, local_verifier):
    stub = VerifierServiceStub(verifier_channel)
    info = await stub.GetInfo(VerifierGetInfoRequest())
    assert (info.kv_bytes, info.active_sessions, info.vocab_size) == (0, 0, local_verifier.target.vocab_size)
    assert info.hidden_size == 48 and info.model.endswith("target")
    await stub.Prefill(prefill_request("k"))
    local_verifier.prefill("k", PROMPT, SamplingParams())
    assert (await stub.GetInfo(VerifierGetInfoRequest())).kv_bytes == local_verifier.kv_bytes() > 0
    await stub.Release(VerifierReleaseRequest(session_id="k"))
    assert (await stub.GetInfo(VerifierGetInfoRequest())).kv_bytes == 0


async def test_cancelled_verify_leaves_the_session_consistent(verifier, verifier_channel, local_verifier):
    """Cancelled while queued: skipped. Cancelled while running: runs to the end.
    Either way the session equals an engine that ran exactly the calls that ran."""
    server, servicer = verifier
    stub = VerifierServiceStub(verifier_channel)
    cont = greedy_continuation(local_verifier, PROMPT, 6)
    vocab = local_verifier.target.vocab_size
    await stub.Prefill(prefill_request("c"))
    local_verifier.prefill("c", PROMPT, SamplingParams())

    # 1) queued behind a busy worker, cancelled by its deadline: never runs
    gate = threading.Event()
    servicer._executor.submit(gate.wait, 10)
    tree = two_hit_tree(cont[0], cont[1:3], vocab)
    err = await rpc_error(stub.Verify(verify_request("c", tree), timeout=0.2))
    assert err.code() == CODE.DEADLINE_EXCEEDED
    for _ in range(200):                                  # the server side sees the deadline too
        if server.in_flight == 0:
            break
        await asyncio.sleep(0.01)
    assert server.in_flight == 0
    gate.set()
    await asyncio.wrap_future(servicer._executor.submit(lambda: None))    # the worker has drained
    assert servicer.engine.committed_tokens("c") == local_verifier.committed_tokens("c")

    # 2) cancelled by the client while the forward runs: the verify completes
    started, finish = threading.Event(), threading.Event()
    real_verify = servicer.engine.verify

    def slow_verify(sid, tree):
        started.set()
        finish.wait(10)
        return real_verify(sid, tree)

    servicer.engine.verify = slow_verify
    call = stub.Verify(verify_request("c", tree))
    await asyncio.to_thread(started.wait, 10)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    finish.set()
    await asyncio.wrap_future(servicer._executor.submit(lambda: None))    # the worker is done with it
    servicer.engine.verify = real_verify
    local_verifier.verify("c", tree)
    assert servicer.engine.committed_tokens("c") == local_verifier.committed_tokens("c") == PROMPT + cont[:4]
    next_tree = tree_from_lists([cont[3], cont[4]], [-1, 0])
    got = await stub.Verify(verify_request("c", next_tree))
    assert list(got.tokens) == local_verifier.verify("c", next_tree).tokens


async def test_solo_threads_while_at_most_one_session_is_open(tiny_family, local_verifier):
    """--solo-threads: engine calls run with all the solo threads while at most
    one session is open (counting the one a Prefill opens), with the worker's
    own count otherwise; tokens are those of the in-process engine either way."""
    solo, before = 3, torch.get_num_threads()
    server, servicer = await start_verifier(tiny_family, solo_threads=solo, metrics_port=None)
    try:
        async with channel_to(server) as ch:
            stub = VerifierServiceStub(ch)
            shared = servicer._shared_threads          # read on the worker thread at load
            assert shared is not None and shared != solo

            async def worker_threads() -> int:
                return (await servicer.run(torch.get_num_threads))[0]

            assert await worker_threads() == solo
            a = (await stub.Prefill(prefill_request("a"))).token
            assert await worker_threads() == solo
            b = (await stub.Prefill(prefill_request("b", prompt=PROMPT[:4]))).token
            assert await worker_threads() == shared
            # a Prefill that opens the second session already runs with the shared count
            assert (await stub.Release(VerifierReleaseRequest(session_id="b"))).released
            seen = []
            original = servicer.engine.prefill
            servicer.engine.prefill = lambda *args: (seen.append(torch.get_num_threads()), original(*args))[1]
            try:
                assert (await stub.Prefill(prefill_request("b", prompt=PROMPT[:4]))).token == b
            finally:
                servicer.engine.prefill = original
            assert seen == [shared]
            got = (await stub.Verify(verify_request("a", tree_from_lists([a], [-1])))).tokens
            assert await worker_threads() == shared
            assert (await stub.Release(VerifierReleaseRequest(session_id="b"))).released
            assert await worker_threads() == solo
        assert [a, *got] == greedy_continuation(local_verifier, PROMPT, 2)
    finally:
        await server.stop()
        # the worker's counts reach process-wide state (MKL's thread count): later tests that compare
        # a served engine's floats with an in-process one's to the last bit need this process's own back
        torch.set_num_threads(before)


async def test_a_cut_tree_answers_in_the_drafted_trees_numbering(verifier, verifier_channel, local_verifier):
    _, servicer = verifier
    servicer.engine.sizer = CutTo(3)
    stub = VerifierServiceStub(verifier_channel)
    vocab = local_verifier.target.vocab_size
    cont = greedy_continuation(local_verifier, PROMPT, 6)
    await stub.Prefill(prefill_request("cut"))
    # root -> {wrong (valued low), right[0] -> {right[1], wrong}}: the 3 best nodes are 0, 2, 3
    tree = two_hit_tree(cont[0], cont[1:3], vocab)
    tree = type(tree)(tree.tokens, tree.parents, tree.depths, torch.tensor([0.0, -4.0, -0.1, -0.2, -5.0]))
    got = await stub.Verify(verify_request("cut", tree))
    assert got.verified_nodes == 3
    assert list(got.accepted_nodes) == [2, 3] and list(got.tokens) == cont[1:4]
    # a sampled session's trees are verified as drafted
    root = (await stub.Prefill(prefill_request("sampled", params=SamplingParams(temperature=1.0, seed=3)))).token
    sampled = two_hit_tree(root, [1, 2], vocab)
    assert (await stub.Verify(verify_request("sampled", sampled))).verified_nodes == 5
    await stub.Release(VerifierReleaseRequest(session_id="cut"))
    assert "cut" not in servicer.engine.sizer.sessions
