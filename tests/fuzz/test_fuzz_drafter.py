"""Property-based fuzzing of DrafterService (Prefill, Draft, DraftAhead, Commit,
Rollback, Release, GetInfo) on a real EAGLE drafter: the properties of
``test_fuzz_verifier``. Features are drawn either right (the shape the call
needs, [rows, hidden] float32) or as an arbitrary Tensor message."""

from __future__ import annotations

import uuid

import grpc
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from fuzz_strategies import (answer_of, assert_documented, examples, feature_choices, int32s, sampling_params,
                             session_choices, texts, token_ids, tree_params)
from specdec.v1 import common_pb2
from specdec.v1.drafter_pb2 import (DraftAheadRequest, DrafterCommitRequest, DrafterGetInfoRequest,
                                    DrafterPrefillRequest, DrafterReleaseRequest, DrafterRenewRequest,
                                    DrafterRollbackRequest, DraftRequest)

PROMPT = [5, 17, 42, 8, 99, 3]
commits = st.lists(token_ids, max_size=6)
# INVALID_ARGUMENT names the field (issue 18, part 2); it once did not for
# "token id -1 is outside the drafter vocabulary [0, 300)" (token_ids / commit_tokens),
# "drafter prefill needs at least one token", "eagle drafter prefill needs at least 2 tokens ..." (token_ids).
field_named = pytest.mark.parametrize("field_named", [True])


def features(targets, choice, rows: int) -> common_pb2.Tensor | None:
    if choice == "right":
        return common_pb2.Tensor(data=bytes(4 * rows * targets.hidden), dtype="float32", shape=[rows, targets.hidden])
    if choice == "none":
        return None
    return choice


def open_session(targets) -> str:
    sid = f"fuzz-{uuid.uuid4().hex}"
    targets.drafter.Prefill(DrafterPrefillRequest(session_id=sid, token_ids=PROMPT,
                                                  features=features(targets, "right", len(PROMPT) - 1),
                                                  greedy=True), timeout=30)
    return sid


def release(targets, sid: str) -> None:
    try:
        targets.drafter.Release(DrafterReleaseRequest(session_id=sid), timeout=30)
    except grpc.RpcError:
        pass


def resolve(choice: str, live: str) -> str:
    return {"live": live, "unknown": f"never-opened-{uuid.uuid4().hex}", "empty": "", "long": "s" * 100_000}[choice]


def run_fuzz(targets, witness, body) -> None:
    since = witness.completed
    body()
    targets.assert_serving()
    witness.assert_undisturbed(since)
    assert len(targets.stack.servicer("drafter").sessions) <= 2


@field_named
def test_prefill(targets, witness, field_named):
    @examples(50)
    @given(choice=session_choices, tokens=st.lists(token_ids, max_size=40), feats=feature_choices,
           greedy=st.booleans(), sampling=st.none() | sampling_params())
    @example(choice="unknown", tokens=[], feats="none", greedy=True, sampling=None)   # a known gap
    def fuzz(choice, tokens, feats, greedy, sampling):
        live = open_session(targets)
        sid = resolve(choice, live)
        request = DrafterPrefillRequest(session_id=sid, token_ids=tokens,
                                        features=features(targets, feats, max(len(tokens) - 1, 0)),
                                        greedy=greedy, sampling=sampling)
        answer = answer_of(targets.drafter.Prefill, request)
        release(targets, live)
        if answer[0] == "OK":
            release(targets, sid)
        assert_documented(answer, request, field_named)

    run_fuzz(targets, witness, fuzz)


@field_named
def test_draft(targets, witness, field_named):
    @examples(50)
    @given(choice=session_choices, commit=commits, feats=feature_choices, tree=tree_params(), ahead=st.booleans())
    @example(choice="live", commit=[-1], feats="right", tree=common_pb2.TreeParams(), ahead=False)   # a known gap
    def fuzz(choice, commit, feats, tree, ahead):
        live = open_session(targets)
        request = DraftRequest(session_id=resolve(choice, live), commit_tokens=commit,
                               commit_features=features(targets, feats, len(commit)), tree=tree, ahead=ahead)
        answer = answer_of(targets.drafter.Draft, request)
        release(targets, live)
        assert_documented(answer, request, field_named)

    run_fuzz(targets, witness, fuzz)


@field_named
def test_draft_ahead(targets, witness, field_named):
    @examples(40)
    @given(choice=session_choices, commit=commits, feats=feature_choices, tree=tree_params(), count=int32s,
           tokens_left=int32s)
    @example(choice="live", commit=[-1], feats="right", tree=common_pb2.TreeParams(), count=1,
             tokens_left=0)                  # a known gap
    def fuzz(choice, commit, feats, tree, count, tokens_left):
        live = open_session(targets)
        request = DraftAheadRequest(session_id=resolve(choice, live), commit_tokens=commit,
                                    commit_features=features(targets, feats, len(commit)), tree=tree, count=count,
                                    tokens_left=tokens_left)
        answer = answer_of(targets.drafter.DraftAhead, request)
        release(targets, live)
        assert_documented(answer, request, field_named)

    run_fuzz(targets, witness, fuzz)


@field_named
def test_commit_and_rollback(targets, witness, field_named):
    @examples(40)
    @given(choice=session_choices, commit=commits, feats=feature_choices, length=int32s)
    @example(choice="live", commit=[-1], feats="right", length=0)           # a known gap
    def fuzz(choice, commit, feats, length):
        live = open_session(targets)
        sid = resolve(choice, live)
        commit_request = DrafterCommitRequest(session_id=sid, token_ids=commit,
                                              features=features(targets, feats, len(commit)))
        rollback_request = DrafterRollbackRequest(session_id=sid, length=length)
        answers = [answer_of(targets.drafter.Commit, commit_request),
                   answer_of(targets.drafter.Rollback, rollback_request)]
        release(targets, live)
        assert_documented(answers[0], commit_request, field_named)
        assert_documented(answers[1], rollback_request, field_named)

    run_fuzz(targets, witness, fuzz)


def test_release_and_get_info(targets, witness):
    @examples(30)
    @given(choice=session_choices)
    def fuzz(choice):
        live = open_session(targets)
        request = DrafterReleaseRequest(session_id=resolve(choice, live))
        answer = answer_of(targets.drafter.Release, request)
        release(targets, live)
        assert_documented(answer, request)
        assert_documented(answer_of(targets.drafter.GetInfo, DrafterGetInfoRequest()), DrafterGetInfoRequest())

    run_fuzz(targets, witness, fuzz)


def test_renew(targets, witness):
    @examples(30)
    @given(owner=st.one_of(texts, st.just("o" * 100_000)), choices=st.lists(session_choices, max_size=4))
    def fuzz(owner, choices):
        live = open_session(targets)
        request = DrafterRenewRequest(owner=owner, session_ids=[resolve(c, live) for c in choices])
        answer = answer_of(targets.drafter.Renew, request)
        release(targets, live)
        assert_documented(answer, request)

    run_fuzz(targets, witness, fuzz)
