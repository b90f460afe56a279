"""DrafterService over real gRPC: the same trees as an in-process drafter fed
the same commits, knobs clamped to the server's limits, error statuses."""

import grpc
import pytest
import torch

from serving.helpers import channel_to, eventually, rpc_error, start_drafter
from specdec.request import wire
from specdec.request.params import SamplingParams
from specdec.request.params import TreeParams
from specdec.serving import tensor_wire
from specdec.v1 import common_pb2
from specdec.v1.drafter_pb2 import (DrafterCommitRequest, DrafterGetInfoRequest, DrafterPrefillRequest,
                                    DrafterReleaseRequest, DrafterRollbackRequest, DraftRequest)
from specdec.v1.drafter_pb2_grpc import DrafterServiceStub

pytestmark = pytest.mark.asyncio

PROMPT = [5, 17, 42, 8, 99, 23, 5, 17]
CODE = grpc.StatusCode
LIMITS = TreeParams(total_tokens=10, depth=3, expand_k=3)
DEFAULT = TreeParams(total_tokens=6, depth=2, expand_k=2)


def assert_same_tree(msg, tree):
    assert list(msg.tokens) == tree.tokens.tolist()
    assert list(msg.parents) == tree.parents.tolist()
    assert torch.equal(torch.tensor(list(msg.values), dtype=torch.float32), tree.values)


def feats(t):
    return tensor_wire.tensor_to_proto(t) if t is not None else common_pb2.Tensor()


@pytest.mark.parametrize("kind", ["eagle", "draft-lm", "ngram"])
async def test_draft_with_commit_matches_in_process_drafter(tiny_family, kind, local_verifier, make_local_drafter):
    server, servicer = await start_drafter(tiny_family, kind, default_tree=DEFAULT, limits=LIMITS,
                                           metrics_port=None)
    reference = make_local_drafter(kind)
    eagle = kind == "eagle"
    try:
        async with channel_to(server) as ch:
            stub = DrafterServiceStub(ch)
            info = await stub.GetInfo(DrafterGetInfoRequest())
            assert (info.kind, info.needs_features, info.vocab_size) == (kind, eagle, reference.vocab_size)
            first = local_verifier.prefill("d", PROMPT, SamplingParams())
            f0 = first.features if eagle else None
            reference.prefill("d", PROMPT + [first.token], f0)
            await stub.Prefill(DrafterPrefillRequest(session_id="d", token_ids=PROMPT + [first.token], features=feats(f0),
                                                     greedy=True))
            assert servicer.drafter.sessions.get("d").greedy
            reference.sessions.get("d").greedy = True
            commit, commit_f = [], None
            for cycle in range(4):
                knobs = TreeParams(method=("eagle2", "chain", "no-rerank", "static")[cycle],
                                   total_tokens=5 + cycle, depth=2, expand_k=2)
                if commit:
                    reference.commit("d", commit, commit_f)
                want = reference.draft("d", knobs)
                got = await stub.Draft(DraftRequest(session_id="d", commit_tokens=commit, commit_features=feats(commit_f),
                                                    tree=wire.tree_params_to_proto(knobs)))
                assert_same_tree(got.tree, want)
                assert got.compute_s > 0
                result = local_verifier.verify("d", want)
                commit, commit_f = result.tokens, (result.features if eagle else None)
            assert servicer.drafter.sessions.get("d").tokens == reference.sessions.get("d").tokens
    finally:
        await server.stop()


async def test_knobs_default_and_clamp_to_limits(tiny_family, local_verifier, make_local_drafter):
    server, _ = await start_drafter(tiny_family, "eagle", default_tree=DEFAULT, limits=LIMITS, metrics_port=None)
    reference = make_local_drafter("eagle")
    try:
        async with channel_to(server) as ch:
            stub = DrafterServiceStub(ch)
            info = await stub.GetInfo(DrafterGetInfoRequest())
            assert (info.max_tree.total_tokens, info.max_tree.depth, info.max_tree.expand_k) == (10, 3, 3)
            first = local_verifier.prefill("k", PROMPT, SamplingParams())
            reference.prefill("k", PROMPT + [first.token], first.features)
            await stub.Prefill(DrafterPrefillRequest(session_id="k", token_ids=PROMPT + [first.token],
                                                     features=tensor_wire.tensor_to_proto(first.features)))
            huge = common_pb2.TreeParams(method=common_pb2.TREE_METHOD_EAGLE2, total_tokens=1000, depth=50, expand_k=64)
            vanilla = common_pb2.TreeParams(method=common_pb2.TREE_METHOD_VANILLA)
            # all zero: the server default; far past the limits: clamped to them; vanilla: the root alone
            commit, commit_f = [], None
            for knobs, effective in ((common_pb2.TreeParams(), DEFAULT), (huge, LIMITS), (vanilla, None)):
                if commit:
                    reference.commit("k", commit, commit_f)
                got = await stub.Draft(DraftRequest(session_id="k", commit_tokens=commit, commit_features=feats(commit_f),
                                                    tree=knobs))
                if effective is None:
                    assert list(got.tree.tokens) == [commit[-1]] and list(got.tree.parents) == [-1]
                    break
                want = reference.draft("k", effective)
                assert_same_tree(got.tree, want)
                assert len(want.tokens) == effective.total_tokens and want.depths.max() <= effective.depth
                result = local_verifier.verify("k", want)
                commit, commit_f = result.tokens, result.features
            err = await rpc_error(stub.Draft(DraftRequest(session_id="k", tree=common_pb2.TreeParams(depth=-1))))
            assert err.code() == CODE.INVALID_ARGUMENT and "tree.depth must be >= 0" in err.details()
    finally:
        await server.stop()


async def test_bad_features_and_sessions(tiny_family, local_verifier, make_local_drafter):
    server, _ = await start_drafter(tiny_family, "eagle", max_sessions=2, metrics_port=None)
    reference = make_local_drafter("eagle")
    try:
        async with channel_to(server) as ch:
            stub = DrafterServiceStub(ch)
            first = local_verifier.prefill("a", PROMPT, SamplingParams())
            ids = PROMPT + [first.token]
            f = tensor_wire.tensor_to_proto(first.features)
            err = await rpc_error(stub.Prefill(DrafterPrefillRequest(session_id="x", token_ids=ids)))
            assert err.code() == CODE.INVALID_ARGUMENT and "features.shape must be [8, 48]" in err.details()
            wide = tensor_wire.tensor_to_proto(torch.zeros(len(PROMPT), 49))
            err = await rpc_error(stub.Prefill(DrafterPrefillRequest(session_id="x", token_ids=ids, features=wide)))
            assert err.code() == CODE.INVALID_ARGUMENT and "got [8, 49]" in err.details()
            broken = common_pb2.Tensor(data=b"\0" * 3, dtype="float32", shape=[1, 48])
            err = await rpc_error(stub.Prefill(DrafterPrefillRequest(session_id="x", token_ids=ids, features=broken)))
            assert err.code() == CODE.INVALID_ARGUMENT and "features.shape [1, 48]" in err.details()

            await stub.Prefill(DrafterPrefillRequest(session_id="a", token_ids=ids, features=f))
            reference.prefill("a", ids, first.features)
            await stub.Prefill(DrafterPrefillRequest(session_id="b", token_ids=ids, features=f))
            err = await rpc_error(stub.Prefill(DrafterPrefillRequest(session_id="c", token_ids=ids, features=f)))
            assert err.code() == CODE.RESOURCE_EXHAUSTED
            err = await rpc_error(stub.Draft(DraftRequest(session_id="a", commit_tokens=[3])))
            assert err.code() == CODE.INVALID_ARGUMENT and "commit_features.shape must be [1, 48]" in err.details()
            err = await rpc_error(stub.Draft(DraftRequest(session_id="a", commit_features=tensor_wire.tensor_to_proto(
                torch.zeros(1, 48)))))
            assert err.code() == CODE.INVALID_ARGUMENT and "without commit_tokens" in err.details()
            err = await rpc_error(stub.Draft(DraftRequest(session_id="a", commit_tokens=[10**6],
                                                          commit_features=tensor_wire.tensor_to_proto(torch.zeros(1, 48)))))
            assert err.code() == CODE.INVALID_ARGUMENT and "outside the drafter vocabulary" in err.details()
            err = await rpc_error(stub.Draft(DraftRequest(session_id="zzz")))
            assert err.code() == CODE.NOT_FOUND
            err = await rpc_error(stub.Rollback(DrafterRollbackRequest(session_id="a", length=100)))
            assert err.code() == CODE.INVALID_ARGUMENT and "rollback length" in err.details()

            # none of it disturbed "a": commit + rollback + draft still match the reference
            extra = torch.randn(2, 48, generator=torch.Generator().manual_seed(3))
            await stub.Commit(DrafterCommitRequest(session_id="a", token_ids=[7, 9], features=tensor_wire.tensor_to_proto(extra)))
            reference.commit("a", [7, 9], extra)
            await stub.Rollback(DrafterRollbackRequest(session_id="a", length=len(ids) + 1))
            reference.rollback("a", len(ids) + 1)
            got = await stub.Draft(DraftRequest(session_id="a"))
            assert_same_tree(got.tree, reference.draft("a", TreeParams()))
            assert (await stub.Release(DrafterReleaseRequest(session_id="b"))).released
            assert not (await stub.Release(DrafterReleaseRequest(session_id="b"))).released
            assert (await stub.GetInfo(DrafterGetInfoRequest())).active_sessions == 1
    finally:
        await server.stop()


async def test_idle_drafter_session_is_evicted(tiny_family):
    server, servicer = await start_drafter(tiny_family, "ngram", session_ttl=0.2, metrics_port=None)
    try:
        async with channel_to(server) as ch:
            stub = DrafterServiceStub(ch)
            await stub.Prefill(DrafterPrefillRequest(session_id="n", token_ids=PROMPT))
            assert len((await stub.Draft(DraftRequest(session_id="n"))).tree.tokens) > 1   # "5, 17" repeats
            assert await eventually(lambda: "n" not in servicer.sessions)     # swept past its 0.2 s TTL
            err = await rpc_error(stub.Draft(DraftRequest(session_id="n")))
            assert err.code() == CODE.NOT_FOUND and "evicted" in err.details()
            assert servicer.stats.active == 0
    finally:
        await server.stop()


def assert_same_proposals(msg, tree):
    got = {p.node: (list(p.tokens), list(p.probs)) for p in msg.proposals}
    want = {n: (p.tokens.tolist(), p.probs.tolist()) for n, p in (tree.proposals or {}).items()}
    assert got == want


@pytest.mark.parametrize("kind", ["eagle", "draft-lm", "ngram"])
async def test_sampled_session_ships_its_proposals(tiny_family, kind, local_verifier, make_local_drafter):
    """A session prefilled with T > 0 and a seed gets drawn trees with their
    proposals, the same as an in-process drafter's; proposals=TOP, a greedy
    session and the n-gram drafter get fixed-token trees."""
    server, _ = await start_drafter(tiny_family, kind, default_tree=DEFAULT, limits=LIMITS, metrics_port=None)
    reference = make_local_drafter(kind)
    eagle = kind == "eagle"
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    knobs = TreeParams(total_tokens=8, depth=3, expand_k=3)
    try:
        async with channel_to(server) as ch:
            stub = DrafterServiceStub(ch)
            first = local_verifier.prefill("s", PROMPT, params)
            f0 = first.features if eagle else None
            reference.prefill("s", PROMPT + [first.token], f0, sampling=params)
            await stub.Prefill(DrafterPrefillRequest(session_id="s", token_ids=PROMPT + [first.token],
                                                     features=feats(f0), sampling=wire.sampling_to_proto(params)))
            commit, commit_f = [], None
            for _ in range(3):
                if commit:
                    reference.commit("s", commit, commit_f)
                want = reference.draft("s", knobs)
                got = await stub.Draft(DraftRequest(session_id="s", commit_tokens=commit,
                                                    commit_features=feats(commit_f),
                                                    tree=wire.tree_params_to_proto(knobs)))
                assert_same_tree(got.tree, want)
                assert_same_proposals(got.tree, want)
                assert bool(got.tree.proposals) == (kind != "ngram")
                result = local_verifier.verify("s", tensor_wire.tree_from_proto(got.tree, reference.vocab_size))
                commit, commit_f = result.tokens, (result.features if eagle else None)
            top = await stub.Draft(DraftRequest(session_id="s", commit_tokens=commit, commit_features=feats(commit_f),
                                                tree=wire.tree_params_to_proto(TreeParams(proposals="top"))))
            assert not top.tree.proposals and (len(top.tree.tokens) > 1 or kind == "ngram")
            await stub.Prefill(DrafterPrefillRequest(session_id="g", token_ids=PROMPT + [first.token],
                                                     features=feats(f0),
                                                     sampling=wire.sampling_to_proto(SamplingParams(seed=3))))
            greedy = await stub.Draft(DraftRequest(session_id="g", tree=wire.tree_params_to_proto(knobs)))
            assert not greedy.tree.proposals and (len(greedy.tree.tokens) > 1 or kind == "ngram")
    finally:
        await server.stop()
