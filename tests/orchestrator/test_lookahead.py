"""Drafting one round ahead through the services (``--lookahead``): the
orchestrator verifies a tree while the drafter drafts the next round, and uses
a tree drafted ahead when the verifier commits its outcome. Greedy output is
unchanged, hits are counted (stats and metric), sampled sessions never look
ahead, the DraftAhead RPC rejects bad input with a status, hits are exactly
the cycles that skipped a Draft, and a drafting budget keeps the likeliest
paths first."""

import grpc
import pytest
import torch

from running_stack import Stack
from running_stack import Tap
from serving.helpers import drafter_builder, rpc_error, verifier_builder
from specdec.client import SpecdecClient
from specdec.local import generate
from specdec.model.loading import load_tokenizer
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from specdec.serving.metrics import REGISTRY
from specdec.v1 import common_pb2
from specdec.v1.drafter_pb2 import DraftAheadRequest, DrafterPrefillRequest, DraftRequest
from specdec.v1.drafter_pb2_grpc import DrafterServiceStub

PROMPT = "def add(a, b):"
N = 40
CHAIN = dict(method="chain", total_tokens=6, depth=5)


@pytest.fixture(scope="module")
def stack(tiny_family):
    s = Stack(tiny_family)
    s.add_verifier("verifier")
    s.add_orchestrator("plain")
    for kind in ("oracle", "eagle"):
        s.add_drafter(kind, kind)
        s.add_orchestrator(f"{kind}-ahead", drafter=kind, lookahead=3, lookahead_budget=False)
    yield s
    s.close()


def hits_metric(outcome: str) -> float:
    return REGISTRY.get_sample_value("specdec_ahead_cycles_total", {"outcome": outcome}) or 0.0


def test_greedy_output_unchanged_and_trees_ready(stack):
    with SpecdecClient(stack.address("plain")) as client:
        plain = client.complete(PROMPT, max_new_tokens=N)
    before = hits_metric("hit")
    with SpecdecClient(stack.address("oracle-ahead")) as client:
        got = client.complete(PROMPT, max_new_tokens=N, **CHAIN)
    assert got.token_ids == plain.token_ids
    s = got.stats
    # the oracle's chain is accepted whole; every cycle after the first (drafted plainly) was ready
    assert s.tau > 5.0
    assert s.ahead_hits == s.cycles - 1, s
    # the stats carry what those cycles committed: every token but the prefill's and the first cycle's
    assert 0 < s.ahead_committed < s.completion_tokens and s.ahead_committed >= 5 * s.ahead_hits
    assert hits_metric("hit") == before + s.ahead_hits
    assert 0 < s.ahead_draft_s < s.wall_s
    with SpecdecClient(stack.address("eagle-ahead")) as client:
        for method in ("eagle2", "static"):
            assert client.complete(PROMPT, max_new_tokens=N, method=method).token_ids == plain.token_ids


def test_sampled_sessions_do_not_look_ahead(stack, tiny_family):
    from specdec.request.decoding import StopCriteria
    from specdec.local import generate
    from specdec.model.loading import load_tokenizer
    from specdec.request.params import SamplingParams
    from specdec.request.params import TreeParams

    params = dict(temperature=0.75, top_p=0.875, top_k=50, seed=7)
    with SpecdecClient(stack.address("oracle-ahead")) as client:
        got = client.complete(PROMPT, max_new_tokens=N, **CHAIN, **params)
    assert got.stats.ahead_hits == 0
    tok = load_tokenizer(tiny_family["target"])
    ids = tok(PROMPT, add_special_tokens=True)["input_ids"]
    want = generate(verifier_builder(tiny_family)(), drafter_builder(tiny_family, "oracle")(), ids,
                    SamplingParams(**params), StopCriteria(max_new_tokens=N, eos_ids=frozenset([tok.eos_token_id])),
                    TreeParams(**CHAIN))
    assert got.token_ids == want.tokens


def test_draft_ahead_rpc_statuses(stack):
    import asyncio

    async def calls():
        async with grpc.aio.insecure_channel(stack.address("eagle")) as channel:
            stub = DrafterServiceStub(channel)
            tree = common_pb2.TreeParams(method=common_pb2.TREE_METHOD_EAGLE2, total_tokens=8, depth=3, expand_k=2)
            out = {"unknown": await rpc_error(stub.DraftAhead(DraftAheadRequest(session_id="nope", tree=tree,
                                                                                count=1)))}
            await stub.Prefill(DrafterPrefillRequest(session_id="s", token_ids=[1, 2], greedy=True,
                                                     features=_zeros(1, stack)))
            await stub.Draft(DraftRequest(session_id="s", tree=tree, ahead=True))
            out["negative"] = await rpc_error(stub.DraftAhead(DraftAheadRequest(session_id="s", tree=tree, count=-1)))
            vanilla = common_pb2.TreeParams(method=common_pb2.TREE_METHOD_VANILLA)
            out["no_tree"] = await rpc_error(stub.DraftAhead(DraftAheadRequest(session_id="s", tree=vanilla,
                                                                               count=1)))
            out["features_alone"] = await rpc_error(stub.DraftAhead(DraftAheadRequest(
                session_id="s", tree=tree, count=1, commit_features=_zeros(2, stack))))
            ok = await stub.DraftAhead(DraftAheadRequest(session_id="s", tree=tree, count=2))
            out["trees"] = [(list(t.commit_tokens), list(t.tree.tokens)) for t in ok.trees]
            return out

    out = stack.loop.run(calls())
    assert out["unknown"].code() == grpc.StatusCode.NOT_FOUND
    assert out["negative"].code() == grpc.StatusCode.INVALID_ARGUMENT and "count" in out["negative"].details()
    assert out["no_tree"].code() == grpc.StatusCode.INVALID_ARGUMENT and "tree" in out["no_tree"].details()
    assert out["features_alone"].code() == grpc.StatusCode.INVALID_ARGUMENT
    # the session survived the bad calls: two paths drafted ahead, each tree rooted at its bonus token
    assert out["trees"] and all(tokens[0] == commit[-1] for commit, tokens in out["trees"])


def _zeros(rows: int, stack) -> common_pb2.Tensor:
    import torch

    from specdec.serving import tensor_wire

    hidden = stack.servicer("eagle").drafter.hidden_size
    return tensor_wire.tensor_to_proto(torch.zeros(rows, hidden), "float32")


# -- hit accounting and the budget ---------------------------------------------------------------------
def test_hits_are_the_cycles_that_skipped_a_draft(stack, monkeypatch):
    """Every cycle with a tree either used one drafted ahead (a hit) or asked
    the drafter for one: hits = cycles - root-only cycles - Draft steps, and
    the metric counts the same hits."""
    tap = Tap(stack.servicer("oracle").drafter, "draft")
    engine = stack.servicer("verifier").engine
    verify, sizes = engine.verify, []
    monkeypatch.setattr(engine, "verify", lambda sid, tree, *a, **kw: sizes.append(tree.size) or verify(sid, tree,
                                                                                                         *a, **kw))
    before = hits_metric("hit")
    try:
        with SpecdecClient(stack.address("oracle-ahead")) as client:
            got = client.complete(PROMPT, max_new_tokens=N, method="eagle2", total_tokens=8, depth=3)
    finally:
        tap.restore()
    s = got.stats
    assert len(sizes) == s.cycles > 1 and s.ahead_hits > 0 and tap.sessions
    assert s.ahead_hits == s.cycles - sizes.count(1) - len(tap.sessions)
    assert hits_metric("hit") == before + s.ahead_hits


def test_budget_drafts_the_likeliest_paths_first(tiny_family):
    """No budget drafts ahead for every path asked for, likeliest first; once a
    forest's time per path is known, a budget too small for two keeps the
    likeliest path alone. Every tree is rooted at its outcome's bonus token."""
    drafter = drafter_builder(tiny_family, "eagle")()
    cfg = TreeParams(method="eagle2", total_tokens=8, depth=3, expand_k=2)
    hidden = drafter.hidden_size
    paths = {}
    for sid, budget in (("all", 0.0), ("tight", 1e-9)):
        drafter.prefill(sid, [1, 2, 3, 4], torch.zeros(3, hidden), greedy=True)
        drafter.draft(sid, cfg, ahead=True)
        drafter.sessions.get(sid).ahead_s_per_end = 0.01 if budget else 0.0
        trees = drafter.draft_ahead(sid, [], None, cfg, count=4, budget_s=budget)
        assert all(tree.tokens[0] == commit[-1] and tree.size > 1 for commit, tree in trees)
        paths[sid] = list(dict.fromkeys(tuple(commit[:-1]) for commit, _ in trees))
    assert len(paths["all"]) > 1 and paths["tight"] == paths["all"][:1]


@pytest.mark.parametrize("kind", ["eagle", "oracle"])
def test_forest_drafted_ahead_is_lossless_and_hits(tiny_family, kind):
    """In-process, EAGLE-2 trees drafted ahead together (``drafter.ahead``):
    greedy output is plain decoding's; a drafter that is the target itself has
    the next tree ready in most cycles."""
    tok = load_tokenizer(tiny_family["target"])
    ids = tok(PROMPT, add_special_tokens=True)["input_ids"]
    stop = StopCriteria(max_new_tokens=N, eos_ids=frozenset([tok.eos_token_id]))
    verifier = verifier_builder(tiny_family)()
    plain = generate(verifier, None, ids, SamplingParams(), stop, None)
    tree = TreeParams(method="eagle2", total_tokens=8, depth=3, expand_k=2)
    got = generate(verifier, drafter_builder(tiny_family, kind)(), ids, SamplingParams(), stop, tree, lookahead=4)
    assert got.tokens == plain.tokens
    if kind == "oracle":
        assert got.stats.ahead_hits >= 0.7 * (got.stats.cycles - 1), got.stats
