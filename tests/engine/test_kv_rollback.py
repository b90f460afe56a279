"""After a verify commits a path, the KV cache equals a fresh prefill of the committed tokens."""

import torch

from specdec.model import kv, masks
from specdec.model.loading import ModelSpec
from specdec.tree.build import tree_from_lists
from verifier.engine import TargetModel


def test_commit_path_matches_fresh_prefill(tiny_family):
    target = TargetModel(ModelSpec(str(tiny_family["target"])))
    gen = torch.Generator().manual_seed(3)
    v = target.vocab_size
    for trial in range(25):
        n = int(torch.randint(1, 14, (1,), generator=gen))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        tree = tree_from_lists(torch.randint(0, v, (n,), generator=gen).tolist(), parents, v)
        prefix = torch.randint(0, v, (int(torch.randint(1, 10, (1,), generator=gen)),), generator=gen)
        cache = target.new_cache()
        target.forward(cache, prefix, torch.arange(len(prefix)), None)
        mask = masks.tree_attention_mask(tree.ancestor_mask(), len(prefix))
        target.forward(cache, tree.tokens, tree.position_ids(len(prefix)), mask)
        # a random accept pattern: root to a random node
        node = int(torch.randint(0, n, (1,), generator=gen))
        path = []
        while node >= 0:
            path.append(node)
            node = int(tree.parents[node])
        path.reverse()
        kv.keep_path(cache, len(prefix), path)

        fresh = target.new_cache()
        seq = torch.cat([prefix, tree.tokens[path]])
        target.forward(fresh, seq, torch.arange(len(seq)), None)
        assert kv.seq_len(cache) == len(seq)
        for got, want in zip(cache.layers, fresh.layers):
            torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=0)
        # and decoding continues identically from both caches
        nxt = torch.tensor([int(torch.randint(0, v, (1,), generator=gen))])
        a = target.forward(cache, nxt, torch.tensor([len(seq)]), None)[1]
        b = target.forward(fresh, nxt, torch.tensor([len(seq)]), None)[1]
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_verifier_rollback_truncates_to_committed_prefix(tiny_family):
    from specdec.request.params import SamplingParams
    from verifier.engine import VerifierEngine

    engine = VerifierEngine(TargetModel(ModelSpec(str(tiny_family["target"]))))
    engine.prefill("s", [5, 6, 7, 8], SamplingParams())
    for _ in range(4):
        engine.verify("s", tree_from_lists([engine.committed_tokens("s")[-1]], [-1]))
    full = engine.committed_tokens("s")
    engine.rollback("s", 6)
    assert engine.committed_tokens("s") == full[:6]
    # decoding after rollback reproduces the original continuation
    for _ in range(3):
        engine.verify("s", tree_from_lists([engine.committed_tokens("s")[-1]], [-1]))
    assert engine.committed_tokens("s") == full[:9]


def test_kv_budget_refuses_instead_of_crashing(tiny_family):
    from specdec.request.errors import ResourceExhausted
    from specdec.request.params import SamplingParams
    from verifier.engine import VerifierEngine

    target = TargetModel(ModelSpec(str(tiny_family["target"])))
    per_session = (10 + 20 + 16) * target.kv_bytes_per_token
    engine = VerifierEngine(target, kv_budget_bytes=2 * per_session + 1, max_tree_tokens=16)
    engine.prefill("a", list(range(1, 11)), SamplingParams(), max_new_tokens=20)
    engine.prefill("b", list(range(1, 11)), SamplingParams(), max_new_tokens=20)
    try:
        engine.prefill("c", list(range(1, 11)), SamplingParams(), max_new_tokens=20)
        raise AssertionError("third session admitted past the KV budget")
    except ResourceExhausted as exc:
        assert "KV budget exhausted" in str(exc)
    assert len(engine.sessions) == 2
    # the admitted sessions keep working and their real usage stays inside the budget
    for sid in ("a", "b"):
        for _ in range(20):
            engine.verify(sid, tree_from_lists([engine.committed_tokens(sid)[-1]], [-1]))
    assert engine.kv_bytes() <= engine.kv_budget_bytes
    engine.release("a")
    engine.prefill("c", list(range(1, 11)), SamplingParams(), max_new_tokens=20)   # room again


def test_resumed_session_continues_exactly(tiny_family):
    """A session moved to another verifier (prefill with resume) decodes on as if never moved."""
    from specdec.request.params import SamplingParams
    from verifier.engine import VerifierEngine

    target = TargetModel(ModelSpec(str(tiny_family["target"])))
    a, b = VerifierEngine(target), VerifierEngine(target)
    a.prefill("s", [4, 5, 6], SamplingParams())
    for _ in range(5):
        a.verify("s", tree_from_lists([a.committed_tokens("s")[-1]], [-1]))
    b.prefill("s", a.committed_tokens("s"), SamplingParams(), resume=True)
    assert b.committed_tokens("s") == a.committed_tokens("s")
    for _ in range(6):
        ra = a.verify("s", tree_from_lists([a.committed_tokens("s")[-1]], [-1]))
        rb = b.verify("s", tree_from_lists([b.committed_tokens("s")[-1]], [-1]))
        assert ra.tokens == rb.tokens
