"""Batched verification of mixed sessions == each session verified alone (greedy,
sampled, penalised), with eager forwards and with compiled ones."""

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from specdec.local import DrafterChoice, build_local, generate
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.errors import FailedPrecondition, NotFound
from specdec.request.params import SamplingParams
from specdec.request.params import TreeParams
from specdec.request.speculative import cycle_tree
from specdec.tree.build import tree_from_lists
from verifier.batch import BatchScheduler, verify_batch

PROMPTS = [[5, 6, 7], [20, 21, 22, 20, 21, 22, 23], [3] * 12, [100, 50, 25, 12], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
CFGS = [TreeParams(total_tokens=t, depth=d, expand_k=k) for t, d, k in [(8, 3, 2), (4, 2, 2), (12, 4, 3), (1, 1, 1), (6, 5, 1)]]
NEW = 30


# compiled: builds every batched graph of the tiny target before readiness (~5 min on an empty compile
# cache), with `make bench`; the batched graphs' own checks are in tests/compile/test_compiled_batch.py
@pytest.fixture(scope="module", params=["off", pytest.param("on", marks=pytest.mark.slow)], ids=["eager", "compiled"])
def stack(tiny_family, request):
    """The tiny stack, eager or with compiled forwards and batched compiled
    graphs (``specdec.compile.batched``: batches of root-only cycles and of
    12-node trees take them, smaller trees run row by row)."""
    built = build_local(ModelSpec(str(tiny_family["target"]), compile=request.param),
                        DrafterChoice("eagle", str(tiny_family["eagle"])))
    assert built.verifier.target.compile_batches() == (request.param == "on")
    return built


PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3)


def params_of(i: int, sampled: bool, penalised: bool = False) -> SamplingParams:
    extra = PENALTIES if penalised else {}
    return SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, **extra) if sampled else SamplingParams(**extra)


def reference(stack, sampled: bool, penalised: bool = False):
    """Each prompt alone: plain greedy decoding, or the seeded speculative run
    (drawn trees, the same draws whatever the batching)."""
    stop = StopCriteria(max_new_tokens=NEW)
    if not sampled:
        return [generate(stack.verifier, None, p, params_of(i, False, penalised), stop, None, logprobs=2)
                for i, p in enumerate(PROMPTS)]
    return [generate(stack.verifier, stack.drafter, p, params_of(i, True, penalised), stop, CFGS[i], logprobs=2)
            for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("sampled,penalised", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_sessions_get_the_tokens_they_get_alone(stack, seed, sampled, penalised):
    """Tokens and logprobs; with penalties each session's nodes are penalised with their own paths."""
    want = reference(stack, sampled, penalised)
    v, d = stack.verifier, stack.drafter
    rng = random.Random(seed)
    sids = [f"s{seed}-{i}" for i in range(len(PROMPTS))]
    out = {sid: [] for sid in sids}
    logprobs = {sid: [] for sid in sids}
    for i, (sid, p) in enumerate(zip(sids, PROMPTS)):
        first = v.prefill(sid, p, params_of(i, sampled, penalised), NEW, logprobs=2)
        d.prefill(sid, p + [first.token], first.features, sampling=params_of(i, sampled, penalised))
        out[sid].append(first.token)
        logprobs[sid].extend(first.logprobs)
    active = list(sids)
    while active:
        # random arrival order and a random subset per batch: mixed prefix lengths and tree sizes
        rng.shuffle(active)
        batch = active[:rng.randint(1, len(active))]
        # trees no deeper than the tokens still wanted, as in generate(): the same trees as alone
        trees = [d.draft(sid, cycle_tree(CFGS[sids.index(sid)], NEW - len(out[sid])) or CFGS[3])
                 for sid in batch]
        results = verify_batch(v, list(zip(batch, trees)))
        for sid, res in zip(batch, results):
            assert not isinstance(res, Exception), res
            out[sid].extend(res.tokens)
            logprobs[sid].extend(res.logprobs)
            d.commit(sid, res.tokens, res.features)
            if len(out[sid]) >= NEW:
                active.remove(sid)
    for sid, w in zip(sids, want):
        assert out[sid][:NEW] == w.tokens
        got = [e.logprob for e in logprobs[sid][:NEW]]
        assert got == pytest.approx([e.logprob for e in w.logprobs], abs=1e-5)
        v.release(sid)
        d.release(sid)


def test_errors_are_per_item_and_leave_others_intact(stack):
    v = stack.verifier
    v.prefill("ok", [5, 6, 7], SamplingParams())
    root = v.committed_tokens("ok")[-1]
    results = verify_batch(v, [("missing", tree_from_lists([1], [-1])),
                               ("ok", tree_from_lists([root, 4], [-1, 0])),
                               ("ok", tree_from_lists([root], [-1]))])
    assert isinstance(results[0], NotFound)
    assert not isinstance(results[1], Exception)
    assert isinstance(results[2], FailedPrecondition)
    v.release("ok")


def test_scheduler_batches_concurrent_calls(stack):
    v = stack.verifier
    want = [dec.tokens for dec in reference(stack, sampled=False)]

    async def one(sched, i, p):
        sid = f"sched-{i}"
        first = v.prefill(sid, p, SamplingParams(), NEW)
        toks = [first.token]
        while len(toks) < NEW:
            res, _ = await sched.verify(sid, tree_from_lists([toks[-1]], [-1]))
            toks.extend(res.tokens)
        v.release(sid)
        return toks[:NEW]

    async def main():
        pool = ThreadPoolExecutor(1)

        async def runner(items):
            return await asyncio.get_running_loop().run_in_executor(pool, v.verify_batch, items), 0.0

        sched = BatchScheduler(runner, lambda: len(v.sessions), window_s=0.05)
        try:
            got = await asyncio.gather(*(one(sched, i, p) for i, p in enumerate(PROMPTS)))
        finally:
            await sched.close()
        return got, sched

    got, sched = asyncio.run(main())
    assert got == want
    assert sched.batched_items > sched.batches       # calls really were packed together
