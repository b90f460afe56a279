"""Request bounds over real gRPC, per backend service: INVALID_ARGUMENT naming
the field, the server still serving afterwards; and the one error mapping
(the server interceptor) for unary calls and unexpected errors.

The bounds themselves are tested field by field in tests/request/test_params.py;
the public API's (orchestrator) in tests/orchestrator/test_e2e.py."""

from __future__ import annotations

import logging
import math

import grpc
import pytest

from serving.helpers import channel_to, rpc_error, start_drafter
from specdec.request import wire
from specdec.request.params import MAX_ID_CHARS, SamplingParams
from specdec.v1 import common_pb2
from specdec.v1.drafter_pb2 import (DraftAheadRequest, DrafterCommitRequest, DrafterPrefillRequest,
                                    DrafterReleaseRequest, DrafterRollbackRequest, DraftRequest)
from specdec.v1.drafter_pb2_grpc import DrafterServiceStub
from specdec.v1.verifier_pb2 import (VerifierPrefillRequest, VerifierReleaseRequest, VerifierRollbackRequest,
                                     VerifyRequest)
from specdec.v1.verifier_pb2_grpc import VerifierServiceStub

pytestmark = pytest.mark.asyncio

PROMPT = [5, 17, 42, 8, 99, 23, 5, 17]
CODE = grpc.StatusCode
LONG_ID = "s" * (MAX_ID_CHARS + 1)
HUGE_ID = "s" * 1_000_000


def sampling(**kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**kw)


def tree(**kw) -> common_pb2.TreeParams:
    return common_pb2.TreeParams(**kw)


VERIFIER_BAD = [
    ("session_id", lambda: VerifierPrefillRequest(session_id=LONG_ID, prompt_ids=PROMPT)),
    ("session_id", lambda: VerifierPrefillRequest(session_id=HUGE_ID, prompt_ids=PROMPT)),
    ("session_id", lambda: VerifyRequest(session_id=LONG_ID)),
    ("session_id", lambda: VerifierRollbackRequest(session_id=LONG_ID)),
    ("session_id", lambda: VerifierReleaseRequest(session_id=LONG_ID)),
    ("sampling.temperature", lambda: VerifierPrefillRequest(session_id="p", prompt_ids=PROMPT,
                                                            sampling=sampling(temperature=math.nan))),
    ("sampling.temperature", lambda: VerifierPrefillRequest(session_id="p", prompt_ids=PROMPT,
                                                            sampling=sampling(temperature=math.inf))),
    ("sampling.top_p", lambda: VerifierPrefillRequest(session_id="p", prompt_ids=PROMPT,
                                                      sampling=sampling(temperature=1.0, top_p=math.nan))),
    ("sampling.top_k", lambda: VerifierPrefillRequest(session_id="p", prompt_ids=PROMPT, sampling=sampling(top_k=-1))),
    ("max_new_tokens", lambda: VerifierPrefillRequest(session_id="p", prompt_ids=PROMPT, max_new_tokens=-5)),
]


async def test_verifier_refuses_out_of_bounds_fields(verifier_channel):
    stub = VerifierServiceStub(verifier_channel)
    calls = {VerifierPrefillRequest: stub.Prefill, VerifyRequest: stub.Verify,
             VerifierRollbackRequest: stub.Rollback, VerifierReleaseRequest: stub.Release}
    for field, build in VERIFIER_BAD:
        request = build()
        err = await rpc_error(calls[type(request)](request))
        assert err.code() == CODE.INVALID_ARGUMENT and err.details().startswith(field), (field, err.details())
    ok = VerifierPrefillRequest(session_id="s" * MAX_ID_CHARS, prompt_ids=PROMPT,
                                sampling=wire.sampling_to_proto(SamplingParams()))
    await stub.Prefill(ok)                                   # the longest id is fine, and the server serves
    assert (await stub.Release(VerifierReleaseRequest(session_id=ok.session_id))).released


DRAFTER_BAD = [
    ("session_id", lambda: DrafterPrefillRequest(session_id=LONG_ID, token_ids=PROMPT)),
    ("session_id", lambda: DraftRequest(session_id=HUGE_ID)),
    ("session_id", lambda: DrafterCommitRequest(session_id=LONG_ID, token_ids=[1])),
    ("session_id", lambda: DrafterRollbackRequest(session_id=LONG_ID)),
    ("session_id", lambda: DrafterReleaseRequest(session_id=LONG_ID)),
    ("sampling.top_p", lambda: DrafterPrefillRequest(session_id="p", token_ids=PROMPT,
                                                     sampling=sampling(temperature=1.0, top_p=1.5))),
    ("tree.value_temperature", lambda: DraftRequest(session_id="d", tree=tree(value_temperature=math.nan))),
    ("tree.value_temperature", lambda: DraftRequest(session_id="d", tree=tree(value_temperature=-1.0))),
    ("tree.value_temperature", lambda: DraftRequest(session_id="d", tree=tree(value_temperature=math.inf))),
    ("tree.total_tokens", lambda: DraftRequest(session_id="d", tree=tree(total_tokens=-1))),
    ("tree.expand_k", lambda: DraftRequest(session_id="d", tree=tree(expand_k=-1))),
    ("tree.method", lambda: DraftRequest(session_id="d", tree=tree(method=99))),
    ("tree.proposals", lambda: DraftRequest(session_id="d", tree=tree(proposals=7))),
    ("count", lambda: DraftAheadRequest(session_id="d", count=-1)),
    ("tokens_left", lambda: DraftAheadRequest(session_id="d", count=1, tokens_left=-1)),
    ("tree.value_temperature", lambda: DraftAheadRequest(session_id="d", count=1,
                                                         tree=tree(value_temperature=math.nan))),
]


async def test_drafter_refuses_out_of_bounds_fields(tiny_family):
    server, _ = await start_drafter(tiny_family, "ngram", metrics_port=None)
    try:
        async with channel_to(server) as ch:
            stub = DrafterServiceStub(ch)
            await stub.Prefill(DrafterPrefillRequest(session_id="d", token_ids=PROMPT, greedy=True))
            calls = {DrafterPrefillRequest: stub.Prefill, DraftRequest: stub.Draft, DraftAheadRequest: stub.DraftAhead,
                     DrafterCommitRequest: stub.Commit, DrafterRollbackRequest: stub.Rollback,
                     DrafterReleaseRequest: stub.Release}
            for field, build in DRAFTER_BAD:
                request = build()
                err = await rpc_error(calls[type(request)](request))
                assert err.code() == CODE.INVALID_ARGUMENT and err.details().startswith(field), (field, err.details())
            drafted = await stub.Draft(DraftRequest(session_id="d", tree=tree(value_temperature=0.5)))
            assert drafted.tree.tokens[0] == PROMPT[-1]                  # "d" is intact and served
    finally:
        await server.stop()


async def test_unexpected_errors_are_internal_and_logged_once(verifier, verifier_channel, monkeypatch, caplog):
    _, servicer = verifier

    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(servicer.engine, "rollback", broken)
    stub = VerifierServiceStub(verifier_channel)
    await stub.Prefill(VerifierPrefillRequest(session_id="r", prompt_ids=PROMPT))
    with caplog.at_level(logging.ERROR, logger="specdec.serving.server"):
        err = await rpc_error(stub.Rollback(VerifierRollbackRequest(session_id="r", length=len(PROMPT))))
    assert err.code() == CODE.INTERNAL and "RuntimeError: boom" in err.details()
    assert sum(1 for r in caplog.records if r.exc_info and "boom" in str(r.exc_info[1])) == 1
    # a domain error keeps its own status
    err = await rpc_error(stub.Verify(VerifyRequest(session_id="nope", tree=common_pb2.DraftTree(tokens=[1],
                                                                                                   parents=[-1]))))
    assert err.code() == CODE.NOT_FOUND
