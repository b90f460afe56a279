"""Batched drafting (drafter.batch): several sessions drafted in one
``draft_batch`` call, or through a drafter server with a batch window, get
exactly the trees each gets alone; bad items fail alone; the sessions' caches
hold only committed inputs afterwards."""

import asyncio
import random
from contextlib import nullcontext

import grpc
import pytest
import torch
from serving.helpers import channel_to, drafter_builder, rpc_error, start_drafter
from trees import assert_same_tree

from specdec.model import kv
from specdec.request import wire
from specdec.request.errors import FailedPrecondition, InvalidArgument, NotFound
from specdec.request.params import SamplingParams, TreeParams
from specdec.serving import tensor_wire
from specdec.v1 import common_pb2
from specdec.v1.drafter_pb2 import DrafterPrefillRequest, DrafterReleaseRequest, DraftRequest
from specdec.v1.drafter_pb2_grpc import DrafterServiceStub
from drafter.batch import DraftScheduler, draft_batch

# Different methods, sizes and depths: trees of one batch stop at different levels.
CONFIGS = [
    TreeParams(method="eagle2", total_tokens=12, depth=4, expand_k=3),
    TreeParams(method="eagle2", total_tokens=6, depth=2, expand_k=2),
    TreeParams(method="chain", total_tokens=6, depth=5),
    TreeParams(method="static", total_tokens=10, depth=3),
    TreeParams(method="no-rerank", total_tokens=9, depth=3, expand_k=2),
    TreeParams(method="no-value", total_tokens=8, depth=4, expand_k=3),
    TreeParams(method="eagle2", total_tokens=16, depth=6, expand_k=4),
    TreeParams(method="chain", total_tokens=1, depth=3),           # the root alone: no level at all
]
PROMPT_LENGTHS = (4, 11, 23, 40, 7)
MODEL_KINDS = ["eagle", "draft-lm"]


class Sessions:
    """The same sessions on a drafter under test and on a reference drafter
    that only ever drafts alone, fed identical random tokens and features."""

    def __init__(self, drafter, reference, seed: int):
        self.drafter, self.reference = drafter, reference
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.hidden = getattr(drafter, "hidden_size", None)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.drafter.vocab_size) for _ in range(n)]

    def features(self, n: int):
        return torch.randn(n, self.hidden, generator=self.gen) if self.drafter.needs_features else None

    def prefill(self, sid: str, n: int, greedy: bool = False, sampling=None) -> None:
        tokens, feats = self.tokens(n), self.features(n - 1)
        for d in (self.drafter, self.reference):
            d.prefill(sid, tokens, feats, greedy=greedy, sampling=sampling)

    def commit(self, max_tokens: int = 4) -> tuple[list[int], object]:
        n = self.rng.randrange(max_tokens + 1)
        return self.tokens(n), (self.features(n) if n else None)

    def want(self, sid: str, tokens, feats, cfg):
        if tokens:
            self.reference.commit(sid, tokens, feats)
        return self.reference.draft(sid, cfg)


def pair(tiny_family, kind: str, greedy_value_temperature: float = 0.7):
    drafters = drafter_builder(tiny_family, kind)(), drafter_builder(tiny_family, kind)()
    for d in drafters:            # greedy sessions then rank by other values than sampled ones
        d.greedy_value_temperature = greedy_value_temperature
    return drafters


def assert_only_committed(drafter, sid: str, just_drafted: bool = True) -> None:
    """The session's cache holds its first ``fed`` committed inputs and nothing
    else; right after a draft, all of them."""
    sess = drafter.sessions.get(sid)
    inputs = drafter._inputs_for(len(sess.tokens))
    assert kv.seq_len(sess.cache) == sess.fed
    assert sess.fed == inputs if just_drafted else sess.fed <= inputs


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_batched_trees_equal_solo_trees(tiny_family, kind, seed):
    drafter, reference = pair(tiny_family, kind)
    s = Sessions(drafter, reference, seed)
    forwards = []
    (drafter.head if kind == "eagle" else drafter.body).register_forward_hook(lambda *_: forwards.append(1))
    sids = [f"s{i}" for i in range(len(PROMPT_LENGTHS))]
    drawn = 0                     # trees with sampled proposals
    for i, (sid, n) in enumerate(zip(sids, PROMPT_LENGTHS)):
        # greedy, sampled with drawn trees, sampled with top-token trees (no sampling params)
        s.prefill(sid, n, greedy=i % 3 == 0, sampling=SamplingParams(0.9, seed=i) if i % 3 == 1 else None)
    for cycle in range(5):
        if cycle == 2:            # a fresh session (empty cache) joins sessions with long caches
            s.prefill("late", 5)
            sids.append("late")
        if cycle == 3:            # a rolled-back session re-feeds its root's input
            for d in (drafter, reference):
                d.rollback("s2", PROMPT_LENGTHS[2] - 3)
        items = []
        for sid in sids:
            # cycle 4 commits nothing anywhere: every root output is reused, no feed runs
            tokens, feats = s.commit() if cycle != 4 else ([], None)
            items.append((sid, tokens, feats, s.rng.choice(CONFIGS)))
        s.rng.shuffle(items)      # arrival order must not matter
        forwards.clear()
        got = draft_batch(drafter, items)
        # one forward feeds every session's pending inputs, then one per tree level for all of them
        levels = max(min(cfg.depth, cfg.total_tokens - 1) for *_, cfg in items)
        assert len(forwards) <= int(cycle != 4) + levels
        for (sid, tokens, feats, cfg), tree in zip(items, got):
            assert_same_tree(tree, s.want(sid, tokens, feats, cfg))
            assert_only_committed(drafter, sid)
            drawn += bool(tree.proposals)
    assert drawn > 0
    # the batched sessions' caches hold exactly what a never-batched drafter's do
    for sid in sids:
        assert drafter.sessions.get(sid).tokens == reference.sessions.get(sid).tokens
        tokens, feats = s.commit()
        cfg = CONFIGS[0]
        if tokens:
            drafter.commit(sid, tokens, feats)
        assert_same_tree(drafter.draft(sid, cfg), s.want(sid, tokens, feats, cfg))
        assert_only_committed(drafter, sid)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_bad_items_fail_alone(tiny_family, kind):
    drafter, reference = pair(tiny_family, kind)
    s = Sessions(drafter, reference, 7)
    for sid, n in (("a", 9), ("b", 14), ("c", 5), ("d", 20), ("e", 6)):
        s.prefill(sid, n)
    ok_a, ok_c = s.commit(), ([], None)
    bad_token = ([3, 10**6], s.features(2))
    cfg = CONFIGS[0]
    items = [("a", *ok_a, cfg),
             ("ghost", [], None, cfg),                       # unknown session
             ("b", *bad_token, cfg),                         # token outside the vocabulary
             ("c", *ok_c, CONFIGS[2]),
             ("a", [], None, CONFIGS[1]),                    # the same session twice
             ("d", [1, 2], None, None)]                      # VANILLA: the root alone, after the commit
    if drafter.needs_features:
        items.append(("e", [4], s.features(3), cfg))         # features of the wrong shape
    got = draft_batch(drafter, items)
    assert_same_tree(got[0], s.want("a", *ok_a, cfg))
    assert isinstance(got[1], NotFound)
    assert isinstance(got[2], InvalidArgument) and "outside the drafter vocabulary" in str(got[2])
    assert_same_tree(got[3], s.want("c", *ok_c, CONFIGS[2]))
    assert isinstance(got[4], FailedPrecondition)
    if drafter.needs_features:
        assert isinstance(got[5], InvalidArgument)           # d's features are missing
        assert isinstance(got[6], InvalidArgument) and "features of shape [1, " in str(got[6])
    else:
        reference.commit("d", [1, 2])
        assert got[5].tokens.tolist() == [2] and got[5].parents.tolist() == [-1]
    # the failed commits left b, d and e untouched: they still draft as the reference does
    for sid in ("a", "b", "c", "d", "e"):
        assert drafter.sessions.get(sid).tokens == reference.sessions.get(sid).tokens
        assert_same_tree(drafter.draft(sid, cfg), reference.draft(sid, cfg))
        assert_only_committed(drafter, sid)


@pytest.mark.parametrize("kind", MODEL_KINDS + ["ngram"])
def test_small_batches_and_ngram_draft_one_by_one(tiny_family, kind):
    drafter, reference = pair(tiny_family, kind)
    s = Sessions(drafter, reference, 3)
    for sid, n in (("x", 12), ("y", 30)):
        s.prefill(sid, n)
    tokens, feats = s.commit()
    [tree] = draft_batch(drafter, [("x", tokens, feats, CONFIGS[0])])          # a lone item
    assert_same_tree(tree, s.want("x", tokens, feats, CONFIGS[0]))
    items = [("x", [], None, CONFIGS[3]), ("y", *s.commit(), CONFIGS[6])]
    for (sid, tokens, feats, cfg), tree in zip(items, draft_batch(drafter, items)):
        assert_same_tree(tree, s.want(sid, tokens, feats, cfg))


def test_scheduler_closes_batches_and_fails_items_alone():
    async def main():
        seen = []

        async def runner(items):
            seen.append([sid for sid, *_ in items])
            await asyncio.sleep(0)
            return [ValueError(sid) if sid == "bad" else sid.upper() for sid, *_ in items], 0.5

        # the window is far longer than the test: batches close on max_batch or on every session joining
        sched = DraftScheduler(runner, expected=lambda: 5, window_s=600.0, max_batch=2)
        calls = [sched.draft(sid, [], None, None) for sid in ("a", "b", "bad", "c")]
        results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=60)
        assert seen == [["a", "b"], ["bad", "c"]]
        assert results[:2] == [("A", 0.5), ("B", 0.5)]
        assert isinstance(results[2], ValueError) and results[3] == ("C", 0.5)
        assert (sched.batches, sched.batched_items, sched.multi_batches) == (2, 4, 2)
        await sched.close()

        # a lone open session never waits for the window; a cancelled call is skipped
        seen.clear()
        lone = DraftScheduler(runner, expected=lambda: 1, window_s=600.0)
        assert await asyncio.wait_for(lone.draft("z", [], None, None), timeout=60) == ("Z", 0.5)
        pair = DraftScheduler(runner, expected=lambda: 2, window_s=600.0)
        gone = asyncio.get_running_loop().create_task(pair.draft("x", [], None, None))
        kept = asyncio.get_running_loop().create_task(pair.draft("y", [], None, None))
        await asyncio.sleep(0)                 # both joined; the batch has not run yet
        gone.cancel()
        assert await asyncio.wait_for(kept, timeout=60) == ("Y", 0.5)
        assert seen == [["z"], ["y"]]
        await lone.close()
        await pair.close()

    asyncio.run(main())


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", MODEL_KINDS)
async def test_server_batches_concurrent_drafts(tiny_family, kind):
    batched, servicer = await start_drafter(tiny_family, kind, batch_window_ms=2000, max_batch=8, metrics_port=None)
    plain, _ = await start_drafter(tiny_family, kind, metrics_port=None)
    s = Sessions(drafter_builder(tiny_family, kind)(), None, 11)
    feats = (lambda t: tensor_wire.tensor_to_proto(t) if t is not None else common_pb2.Tensor())
    try:
        async with channel_to(batched) as ch_b, channel_to(plain) as ch_p:
            stubs = DrafterServiceStub(ch_b), DrafterServiceStub(ch_p)
            sids = [f"r{i}" for i in range(4)]
            for sid, n in zip(sids, PROMPT_LENGTHS):
                tokens, f = s.tokens(n), s.features(n - 1)
                for stub in stubs:
                    await stub.Prefill(DrafterPrefillRequest(session_id=sid, token_ids=tokens, features=feats(f),
                                                             greedy=sid == "r1"))
            for cycle in range(3):
                requests = []
                for sid in sids:
                    tokens, f = s.commit()
                    cfg = s.rng.choice(CONFIGS[:-1] + [None])     # None: VANILLA
                    requests.append(DraftRequest(session_id=sid, commit_tokens=tokens, commit_features=feats(f),
                                                 tree=wire.tree_params_to_proto(cfg)))
                got = await asyncio.gather(*(stubs[0].Draft(r) for r in requests))
                for request, response in zip(requests, got):
                    want = await stubs[1].Draft(request)
                    assert list(response.tree.tokens) == list(want.tree.tokens)
                    assert list(response.tree.parents) == list(want.tree.parents)
                    assert torch.allclose(torch.tensor(list(response.tree.values)),
                                          torch.tensor(list(want.tree.values)), rtol=0, atol=1e-4)
                    assert response.compute_s > 0
            sched = servicer.scheduler
            assert sched.multi_batches >= 1 and sched.batched_items > sched.batches
            for sid in sids:
                assert_only_committed(servicer.drafter, sid, just_drafted=False)   # VANILLA commits, drafts not
                assert (await stubs[0].Release(DrafterReleaseRequest(session_id=sid))).released
            # errors come back with their status (no session open: the lone call runs at once)
            err = await rpc_error(stubs[0].Draft(DraftRequest(session_id="ghost")))
            assert err.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await batched.stop()
        await plain.stop()


def test_drafter_serve_batch_flags(monkeypatch):
    from specdec.cli.main import build_parser

    monkeypatch.delenv("SPECDEC_BATCH_WINDOW_MS", raising=False)
    monkeypatch.delenv("SPECDEC_MAX_BATCH", raising=False)

    args = build_parser().parse_args(["drafter", "serve", "--ngram", "--vocab-size", "10"])
    assert (args.batch_window_ms, args.max_batch) == (2.0, 16)
    monkeypatch.setenv("SPECDEC_BATCH_WINDOW_MS", "0")
    monkeypatch.setenv("SPECDEC_MAX_BATCH", "4")
    args = build_parser().parse_args(["drafter", "serve", "--ngram", "--vocab-size", "10"])
    assert (args.batch_window_ms, args.max_batch) == (0.0, 4)
    args = build_parser().parse_args(["drafter", "serve", "--ngram", "--batch-window-ms", "5", "--max-batch", "3"])
    assert (args.batch_window_ms, args.max_batch) == (5.0, 3)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_a_batch_of_compiled_drafts_reads_back_once(tiny_family, kind):
    """Compiled drafters draft one by one (module doc), each tree left on the
    device, and the batch reads them all in one read: a batch of drafts costs
    the syncs of one; every tree is the one drafted alone."""
    from specdec.bench.cycle_profile import Tally, counting
    from specdec.model.loading import ModelSpec
    from drafter.draft_lm import DraftLmDrafter
    from drafter.eagle.eagle2 import EagleDrafter

    def build():
        if kind == "eagle":
            return EagleDrafter(str(tiny_family["eagle"]), str(tiny_family["target"]), compile="on")
        return DraftLmDrafter(ModelSpec(str(tiny_family["draft-lm"]), compile="on"))

    drafter, reference = build(), build()
    s = Sessions(drafter, reference, 5)
    sids = [f"c{i}" for i in range(3)]
    for i, (sid, n) in enumerate(zip(sids, PROMPT_LENGTHS)):
        s.prefill(sid, n, greedy=i != 1, sampling=SamplingParams(0.9, seed=i) if i == 1 else None)
    configs = [c for c in CONFIGS if c.method != "static" and c.total_tokens > 1]
    for cycle in range(4):
        items = [(sid, [], None, configs[(cycle + j) % len(configs)]) for j, sid in enumerate(sids)]
        tally = Tally()
        with counting(tally) if cycle else nullcontext():     # (the first builds the compiled levels)
            got = draft_batch(drafter, items)
        if cycle:
            assert tally.phases["loop"].kinds["reads"] == 1, tally.phases["loop"].sites
        for (sid, tokens, feats, cfg), tree in zip(items, got):
            assert_same_tree(tree, s.want(sid, tokens, feats, cfg))
        for sid in sids:                                   # the next cycle's root: a committed token
            tokens, feats = s.tokens(1), s.features(1)
            for d in (drafter, reference):
                d.commit(sid, tokens, feats)
