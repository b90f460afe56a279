"""The verifier's prefix cache (``verifier.prefix``) and both engines in process:
a hit leaves greedy and seeded sampled tokens as they are uncached (and, exact,
every bit: tokens and logprobs of a hit equal a miss's), is counted, never
crosses tenants, never serves a token a session did not commit, always runs
the last prompt token, gives way to sessions under the KV budget, and works
on the compiled path."""

import pytest
import torch

from specdec.compile import startup
from specdec.local import DrafterChoice, build_local, generate
from specdec.model.loading import ModelSpec
from specdec.model.prefix_cache import EXACT_BLOCK_TOKENS as B
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from specdec.tree.build import tree_from_lists
from verifier.engine import TargetModel, VerifierEngine

CFG = TreeParams(method="eagle2", total_tokens=10, depth=4, expand_k=3)
STOP = StopCriteria(max_new_tokens=12)
GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.8, seed=3)


def tokens(n, seed, vocab):
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def stacks(tiny_family):
    spec, choice = ModelSpec(str(tiny_family["target"])), DrafterChoice("eagle", str(tiny_family["eagle"]))
    return (build_local(spec, choice), build_local(spec, choice, prefix_cache_tokens=16 * B),
            build_local(spec, choice, prefix_cache_tokens=16 * B, prefix_cache_exact=True))


def exact_engine(target):
    return VerifierEngine(target, prefix_cache_tokens=8 * B, prefix_cache_exact=True)


@pytest.fixture
def engine(stacks):
    return exact_engine(stacks[0].verifier.target)


def run(stack, prompt, params, salt=""):
    return generate(stack.verifier, stack.drafter, prompt, params, STOP, CFG, logprobs=0, cache_salt=salt)


def test_hits_leave_greedy_and_seeded_tokens_as_uncached(stacks):
    plain, cached, _ = stacks
    vocab = plain.verifier.target.vocab_size
    system = tokens(2 * B + 10, 11, vocab)
    for prompt in (system + tokens(9, 12, vocab), system + tokens(4, 13, vocab), system):
        for params in (GREEDY, SAMPLED):
            want, got = run(plain, prompt, params), run(cached, prompt, params)
            assert got.tokens == want.tokens
            for g, w in zip(got.logprobs, want.logprobs):         # float rounding, at most
                assert abs(g.logprob - w.logprob) < 1e-4
    assert cached.verifier.prefix.blocks.stats.hits == 5 and cached.drafter.prefix.stats.hits == 5


def test_exact_hits_change_no_output_bit(stacks):
    plain, _, cached = stacks
    vocab = plain.verifier.target.vocab_size
    system = tokens(2 * B + 10, 1, vocab)
    prompts = [system + tokens(9, 2, vocab), system + tokens(5, 3, vocab), system[:B + 3]]
    verifier, drafter = cached.verifier.prefix.blocks.stats, cached.drafter.prefix.stats
    for prompt in prompts:                # the first run of the first prompt misses, every later one hits
        first, hit = run(cached, prompt, SAMPLED), run(cached, prompt, SAMPLED)
        assert (hit.tokens, hit.logprobs) == (first.tokens, first.logprobs)      # exact floats
        assert run(cached, prompt, GREEDY).tokens == run(plain, prompt, GREEDY).tokens
    assert verifier.hits == drafter.hits == 3 * 3 - 1          # all but the very first prefill hit
    assert verifier.saved_tokens == 2 * B * 5 + B * 3 and drafter.saved_tokens == verifier.saved_tokens
    assert len(cached.verifier.sessions) == len(cached.drafter.sessions) == 0


def test_a_prompt_that_is_all_cached_still_runs_its_last_token(engine):
    prompt = tokens(2 * B, 4, engine.target.vocab_size)
    first = engine.prefill("a", prompt, GREEDY, logprobs=3)
    engine.release("a")
    again = engine.prefill("b", prompt, GREEDY, logprobs=3)
    assert engine.prefix.blocks.stats.hit_tokens == 2 * B and engine.prefix.blocks.stats.saved_tokens == B
    assert (again.token, again.logprobs) == (first.token, first.logprobs)
    assert torch.equal(again.features, first.features)


def test_another_tenant_gets_no_hit(engine):
    prompt = tokens(B + 5, 5, engine.target.vocab_size)
    for sid, salt in (("a", "tenant-a"), ("b", "tenant-b"), ("c", ""), ("d", "tenant-a")):
        engine.prefill(sid, prompt, GREEDY, cache_salt=salt)
        engine.release(sid)
    assert engine.prefix.blocks.stats.hits == 1                 # only tenant-a's second prefill


def test_blocks_never_serve_what_a_session_did_not_commit(engine, stacks):
    vocab = engine.target.vocab_size
    prompt = tokens(2 * B + 1, 6, vocab)
    first = engine.prefill("open", prompt, GREEDY)
    # the open session verifies (its cache gains tree slots), then rolls back into its prompt
    engine.verify("open", tree_from_lists([first.token, 7, 8, 9], [-1, 0, 1, 0]))
    engine.rollback("open", B // 2)
    engine.verify("open", tree_from_lists([prompt[B // 2 - 1], 11, 12], [-1, 0, 1]))
    probe = prompt + tokens(3, 7, vocab)
    got = engine.prefill("probe", probe, GREEDY, logprobs=2)
    want = exact_engine(stacks[0].verifier.target).prefill("probe", probe, GREEDY, logprobs=2)
    assert engine.prefix.blocks.stats.saved_tokens == 2 * B
    assert (got.token, got.logprobs) == (want.token, want.logprobs) and torch.equal(got.features, want.features)


def test_cached_prefixes_give_way_to_sessions_under_the_kv_budget(stacks):
    target = stacks[0].verifier.target
    prompt = tokens(2 * B + 2, 8, target.vocab_size)
    need = (len(prompt) + 4 + 64) * target.kv_bytes_per_token
    engine = VerifierEngine(target, kv_budget_bytes=2 * need + 1000, prefix_cache_tokens=8 * B)
    engine.prefill("a", prompt, GREEDY, max_new_tokens=4)
    assert engine.reserved_bytes() + engine.prefix.blocks.nbytes <= engine.kv_budget_bytes
    cached = len(engine.prefix.blocks)
    engine.prefill("b", prompt, GREEDY, max_new_tokens=4)      # admitted: blocks evicted to make room
    assert engine.prefix.blocks.stats.evictions > 0 and len(engine.prefix.blocks) < cached
    assert engine.reserved_bytes() + engine.prefix.blocks.nbytes <= engine.kv_budget_bytes
    for sid in ("a", "b"):
        engine.release(sid)
    assert len(engine.sessions) == 0 and engine.kv_bytes() == 0


def test_scored_prompts_are_not_looked_up(engine):
    prompt = tokens(B + 9, 9, engine.target.vocab_size)
    engine.prefill("a", prompt, GREEDY)
    engine.release("a")
    scored = engine.prefill("b", prompt, GREEDY, prompt_logprobs=1)
    assert engine.prefix.blocks.stats.lookups == 1 and len(scored.prompt_logprobs) == len(prompt) - 1


def test_the_compiled_path_hits_with_the_same_bits(tiny_family, stacks):
    eager = stacks[0].verifier.target
    fast = TargetModel(ModelSpec(str(tiny_family["target"])), model=eager.model)
    fast.compiled = startup.compile_target(fast.lm, "on")
    engine = exact_engine(fast)
    prompt = tokens(2 * B + 7, 10, eager.vocab_size)
    miss = engine.prefill("a", prompt, GREEDY, logprobs=3)
    assert engine.sessions.get("a").cache.fixed_buffers is not None       # a compiled-path cache
    engine.release("a")
    hit = engine.prefill("b", prompt, GREEDY, logprobs=3)
    assert engine.prefix.blocks.stats.saved_tokens == 2 * B
    assert kv_equal(engine.sessions.get("b").cache, prompt, eager)
    assert (hit.token, hit.logprobs) == (miss.token, miss.logprobs) and torch.equal(hit.features, miss.features)
    assert engine.sessions.get("b").cache.fixed_buffers is not None       # still on the compiled path
    engine.verify("b", tree_from_lists([hit.token], [-1]))


def kv_equal(cache, prompt, eager) -> bool:
    """The loaded cache holds the prompt's K/V (close to an eager prefill's: compiled kernels)."""
    want = eager.new_cache()
    eager.forward(want, torch.tensor(prompt), torch.arange(len(prompt)), None)
    return all(torch.allclose(g.keys, w.keys, atol=1e-4) for g, w in zip(cache.layers, want.layers))


def test_sessions_opened_on_hits_verify_in_one_batch_as_alone(stacks):
    target = stacks[0].verifier.target
    prompt = tokens(2 * B + 3, 14, target.vocab_size)
    batched, alone = exact_engine(target), exact_engine(target)
    opened = []
    for engine in (batched, alone):
        engine.prefill("warm", prompt, GREEDY)
        engine.release("warm")
        opened.append([engine.prefill(sid, prompt + [i + 1], GREEDY).token for i, sid in enumerate("ab")])
    firsts = opened[0]
    assert opened[1] == firsts
    trees = [tree_from_lists([first, 5, 6, 7], [-1, 0, 0, 1]) for first in firsts]
    got = batched.verify_batch(list(zip("ab", trees)))
    want = [alone.verify(sid, tree) for sid, tree in zip("ab", trees)]
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert batched.prefix.blocks.stats.hits == 2
