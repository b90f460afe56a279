"""The three services end to end (real gRPC on 127.0.0.1, port 0; tiny family):
lossless output, stream order, stop strings, seeds, cancellation, deadlines,
bad input, backends going down, auth and metrics."""

import math
import time

import grpc
import pytest

from running_stack import Stack, Tap
from serving.helpers import SessionWatch
from specdec.client import (SpecdecClient, SpecdecDeadlineExceeded, SpecdecInvalidArgument, SpecdecUnauthenticated,
                            SpecdecUnavailable)
from specdec.serving.metrics import REGISTRY
from trees import CutTo

PROMPTS = ["def add(a, b):", "for i in range(3):\n"]
LONG_PROMPT = "class Point:"
N = 24


@pytest.fixture(scope="module")
def stack(tiny_family):
    s = Stack(tiny_family)
    s.add_verifier("verifier")
    s.add_orchestrator("none")
    for kind in ("eagle", "draft-lm", "ngram"):
        s.add_drafter(f"drafter-{kind}", kind)
        s.add_orchestrator(kind, drafter=f"drafter-{kind}")
    yield s
    s.close()


class Local:
    """In-process engines over the same weights: the reference runs."""

    def __init__(self, paths):
        from serving.helpers import drafter_builder, verifier_builder
        from specdec.model.loading import load_tokenizer

        self.verifier = verifier_builder(paths)()
        self.drafters = {kind: drafter_builder(paths, kind)() for kind in ("eagle", "draft-lm", "ngram")}
        self.tok = load_tokenizer(paths["target"])

    def run(self, prompt, kind=None, method=None, n=N, min_tau=0.0, proposals="auto", **sampling):
        from specdec.request.decoding import StopCriteria
        from specdec.local import generate
        from specdec.request.params import SamplingParams
        from specdec.request.params import TreeParams

        ids = self.tok(prompt, add_special_tokens=True)["input_ids"]
        stop = StopCriteria(max_new_tokens=n, eos_ids=frozenset([self.tok.eos_token_id]))
        cfg = TreeParams(method=method, proposals=proposals) if method not in (None, "vanilla") else None
        drafter = self.drafters[kind] if kind in self.drafters else None
        return generate(self.verifier, drafter, ids, SamplingParams(**sampling), stop, cfg, min_tau)

    def text(self, tokens):
        return self.tok.decode(tokens, skip_special_tokens=True)


@pytest.fixture(scope="module")
def local(tiny_family):
    return Local(tiny_family)


def sample(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


CASES = [("none", "vanilla"), ("eagle", "eagle2"), ("eagle", "static"), ("eagle", "no-value"),
         ("eagle", "vanilla"), ("draft-lm", "chain"), ("draft-lm", "no-rerank"), ("ngram", "eagle2"),
         ("ngram", "static")]


@pytest.mark.parametrize("kind,method", CASES)
def test_greedy_matches_in_process_vanilla(stack, local, kind, method):
    with SpecdecClient(stack.address(kind)) as client:
        for prompt in PROMPTS:
            got = client.complete(prompt, max_new_tokens=N, method=method)
            want = local.run(prompt)
            assert got.token_ids == want.tokens
            assert got.text == local.text(want.tokens)
            assert got.stats.finish_reason == "length" and got.stats.completion_tokens == N
            if kind == "none" or method == "vanilla":
                assert got.stats.cycles == N - 1 and got.stats.tau == 1.0 and got.stats.draft_tokens == 0
                continue
            # Same trees as the in-process loop with the same drafter: same cycles and acceptance.
            spec = local.run(prompt, kind, method)
            assert spec.tokens == want.tokens
            assert got.stats.cycles == spec.stats.cycles
            assert got.stats.accepted_per_position == spec.stats.accepted_per_position
            assert got.stats.draft_tokens == spec.stats.drafted
            assert got.stats.accepted_tokens == spec.stats.accepted


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculation_gate_pauses_the_same_cycles_as_in_process(stack, local, temperature):
    """A gate set above what these tiny drafters reach pauses drafting. Sampled,
    the orchestrator pauses exactly the cycles the in-process loop does (the
    gate looks at committed tokens, not clocks), so stats and output agree;
    greedy, the gate is paced (clocks, and what earlier sessions of the same
    pair measured: ``specdec.request.pace``), so only the output must agree."""
    stack.add_orchestrator("gated", drafter="drafter-eagle", min_tau=3.0)
    try:
        with SpecdecClient(stack.address("gated")) as client:
            for prompt in PROMPTS:
                got = client.complete(prompt, max_new_tokens=N, method="eagle2", temperature=temperature, seed=7)
                want = local.run(prompt, "eagle", "eagle2", min_tau=3.0, temperature=temperature, seed=7)
                ungated = local.run(prompt, "eagle", "eagle2", temperature=temperature, seed=7)
                assert got.token_ids == want.tokens
                assert want.stats.drafted < ungated.stats.drafted           # some cycles ran root-only
                if temperature == 0.0:
                    assert got.stats.draft_tokens < ungated.stats.drafted
                    assert want.tokens == ungated.tokens == local.run(prompt).tokens
                else:
                    assert (got.stats.cycles, got.stats.draft_tokens) == (want.stats.cycles, want.stats.drafted)
    finally:
        stack.stop("gated")


def losing(pace):
    """A pair's pace as if its sessions had drafted at a loss: 1.5 tokens a drafted
    cycle costing four plain ones, the last pause 64 cycles."""
    pace.seconds, pace.tokens, pace.pause = {True: 0.04, False: 0.01}, 1.5, 64


def test_greedy_sessions_of_one_pair_share_its_pace(stack, local):
    """The orchestrator keys what cycles cost by the pinned verifier–drafter pair
    (``specdec.request.pace``): a greedy session joining a pair where drafting
    lost starts paused (same output, no draft tokens); a seeded sampled one drafts
    the cycles the in-process loop does, whatever the pair measured."""
    # the relay's pace lives in the orchestrator (the direct plane's in the verifier: test_direct_plane.py)
    stack.add_orchestrator("paced", drafter="drafter-eagle", min_tau=1.5, plane="relay")
    try:
        with SpecdecClient(stack.address("paced")) as client:
            first = client.complete(PROMPTS[0], max_new_tokens=N, method="eagle2")
            assert first.stats.draft_tokens > 0
            paces = stack.servicer("paced").router.paces.table
            (key, pace), = paces.items()
            assert key[:2] == (stack.address("verifier"), stack.address("drafter-eagle"))
            losing(pace)
            joined = client.complete(PROMPTS[0], max_new_tokens=N, method="eagle2")
            sampled = client.complete(PROMPTS[0], max_new_tokens=N, method="eagle2", temperature=1.0, seed=5)
    finally:
        stack.stop("paced")
    assert joined.token_ids == first.token_ids == local.run(PROMPTS[0]).tokens
    assert joined.stats.draft_tokens == 0 and joined.stats.cycles == N - 1
    want = local.run(PROMPTS[0], "eagle", "eagle2", min_tau=1.5, temperature=1.0, seed=5)
    assert sampled.token_ids == want.tokens
    assert (sampled.stats.cycles, sampled.stats.draft_tokens) == (want.stats.cycles, want.stats.drafted)


def test_automatic_gate_follows_the_drafter_kind(stack, local, monkeypatch):
    """``min_tau`` None (``--min-tau auto``): each request's gate takes the
    threshold of the drafter kind it is pinned to (``knobs.default_min_tau``):
    the same cycles as the in-process loop with that threshold. The tiny
    drafters reach τ ~1, so the test gives the kinds thresholds on either side."""
    from specdec.request import knobs

    assert (knobs.default_min_tau("eagle"), knobs.default_min_tau("draft-lm"),
            knobs.default_min_tau("ngram")) == (knobs.DEFAULT_MIN_TAU,) * 2 + (knobs.NGRAM_MIN_TAU,)
    thresholds = {"eagle": 3.0, "draft-lm": 0.0}
    monkeypatch.setattr(knobs, "default_min_tau", lambda kind: thresholds[kind])
    for kind in thresholds:
        stack.add_orchestrator("auto", drafter=f"drafter-{kind}", min_tau=None)
        try:
            with SpecdecClient(stack.address("auto")) as client:
                got = client.complete(PROMPTS[0], max_new_tokens=N, method="eagle2", temperature=1.0, seed=11)
        finally:
            stack.stop("auto")
        runs = {t: local.run(PROMPTS[0], kind, "eagle2", min_tau=t, temperature=1.0, seed=11) for t in (0.0, 3.0)}
        stats = {t: (r.stats.cycles, r.stats.drafted) for t, r in runs.items()}
        assert stats[0.0] != stats[3.0]
        want = runs[thresholds[kind]]
        assert got.token_ids == want.tokens
        assert (got.stats.cycles, got.stats.draft_tokens) == stats[thresholds[kind]]


def test_stream_order_and_final_stats(stack):
    with SpecdecClient(stack.address("eagle")) as client:
        whole = client.complete(LONG_PROMPT, max_new_tokens=40)
        stream = client.generate(LONG_PROMPT, max_new_tokens=40)
        chunks = list(stream)
    assert stream.stats is not None                  # the final message came last, after every chunk
    assert all(c.token_ids or c.text for c in chunks)
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert "".join(c.text for c in chunks) == whole.text
    s = stream.stats
    assert s.completion_tokens == 40 and s.prompt_tokens > 0 and s.finish_reason == "length"
    # The first token comes from prefill; every cycle commits its accepted tokens + a bonus.
    assert s.accepted_tokens + s.cycles >= 39 and s.tau == pytest.approx((s.accepted_tokens + s.cycles) / s.cycles)
    assert sum(s.accepted_per_position) == s.accepted_tokens <= s.draft_tokens
    assert s.draft_s + s.verify_s + s.network_s + s.other_s == pytest.approx(s.wall_s, rel=1e-6, abs=1e-6)
    assert s.draft_s > 0 and s.verify_s > 0 and s.network_s > 0 and 0 < s.ttft_s < s.wall_s
    assert s.request_id


def test_request_id_is_echoed(stack):
    with SpecdecClient(stack.address("none")) as client:
        assert client.complete("x = 1", max_new_tokens=2, request_id="req-42").stats.request_id == "req-42"


def test_stop_strings_end_the_output_before_them(stack, local):
    with SpecdecClient(stack.address("eagle")) as client:
        full = client.complete(LONG_PROMPT, max_new_tokens=40)
        text = full.text
        start = len(text) // 2
        stop = text[start:start + 3]
        cut = text.index(stop)
        got = client.complete(LONG_PROMPT, max_new_tokens=40, stop=[stop, "\x00never"])
        streamed = list(client.generate(LONG_PROMPT, max_new_tokens=40, stop=[stop]))
    assert got.text == text[:cut] and got.stats.finish_reason == "stop"
    assert got.token_ids == full.token_ids[:len(got.token_ids)]
    assert local.text(got.token_ids).startswith(got.text)
    assert "".join(c.text for c in streamed) == got.text
    assert [t for c in streamed for t in c.token_ids] == got.token_ids


def test_seeded_sampling_matches_in_process(stack, local):
    """Drawn trees (the default when sampling) and top-token trees: the same
    seed gives the same tokens through the services as in process."""
    params = dict(temperature=0.75, top_p=0.875, top_k=50, seed=7)
    with SpecdecClient(stack.address("eagle")) as client:
        a = client.complete(PROMPTS[0], max_new_tokens=N, **params)
        b = client.complete(PROMPTS[0], max_new_tokens=N, **params)
        top = client.complete(PROMPTS[0], max_new_tokens=N, proposals="top", **params)
        vanilla = client.complete(PROMPTS[0], max_new_tokens=N, method="vanilla", **params)
    assert a.token_ids == b.token_ids
    assert a.token_ids == local.run(PROMPTS[0], "eagle", "eagle2", **params).tokens
    assert top.token_ids == local.run(PROMPTS[0], "eagle", "eagle2", proposals="top", **params).tokens
    assert vanilla.token_ids == local.run(PROMPTS[0], **params).tokens


def test_cancel_frees_both_sessions(stack):
    before = sample("specdec_requests_total", status="CANCELLED")
    watch = SessionWatch(stack, "verifier", "drafter-eagle")
    with SpecdecClient(stack.address("eagle")) as client:
        stream = client.generate(LONG_PROMPT, max_new_tokens=400)
        next(stream)
        # The first chunk may arrive before the drafter's prefill: wait for both sessions.
        assert stack.wait_sessions("verifier", "drafter-eagle", count=1) == {"verifier": 1, "drafter-eagle": 1}
        stream.close()
        # released (not left for their lease to lapse); cut short: the request counts as cancelled
        assert watch.released() == {"verifier": 0, "drafter-eagle": 0}
    deadline = time.monotonic() + 5
    while sample("specdec_requests_total", status="CANCELLED") < before + 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sample("specdec_requests_total", status="CANCELLED") == before + 1
    assert stack.servicer("eagle").active == 0


def test_deadline_exceeded_frees_both_sessions(stack):
    watch = SessionWatch(stack, "verifier", "drafter-eagle")
    verifies = Tap(stack.servicer("verifier").engine, "verify")
    try:
        with SpecdecClient(stack.address("eagle")) as client:
            t0 = time.monotonic()
            with pytest.raises(SpecdecDeadlineExceeded) as err:
                client.complete(LONG_PROMPT, max_new_tokens=400, timeout=0.3)
            assert time.monotonic() - t0 < 8
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert watch.released() == {"verifier": 0, "drafter-eagle": 0}
            stream = client.generate(LONG_PROMPT, max_new_tokens=400, timeout=0.3)
            with pytest.raises(SpecdecDeadlineExceeded):
                for _ in stream:
                    pass
        assert watch.released() == {"verifier": 0, "drafter-eagle": 0}
    finally:
        verifies.restore()
    assert len(verifies.sessions) < 200         # cut short: 400 tokens take about 400 verifies here, twice


@pytest.mark.parametrize("prompt,params,field", [
    ("", {}, "prompt"),
    ("x", {"max_new_tokens": -1}, "max_new_tokens"),
    ("x", {"max_new_tokens": 5000}, "max_new_tokens"),
    ("x", {"temperature": -0.5}, "temperature"),
    ("x", {"top_p": 1.5}, "top_p"),
    ("x", {"top_p": -0.25}, "top_p"),
    ("x", {"top_k": -3}, "top_k"),
    ("x", {"stop": [""]}, "stop"),
    ("x", {"total_tokens": -2}, "tree.total_tokens"),
    ("x = 1\n" * 200, {"max_new_tokens": 8}, "prompt"),
    ("x", {"max_new_tokens": 600}, "max_new_tokens"),
])
def test_invalid_argument_names_the_field(stack, prompt, params, field):
    with SpecdecClient(stack.address("eagle")) as client:
        with pytest.raises(SpecdecInvalidArgument) as err:
            client.complete(prompt, **params)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details
        assert client.complete("x", max_new_tokens=2).stats.completion_tokens == 2   # the server is fine
    assert stack.open_sessions("verifier", "drafter-eagle") == {"verifier": 0, "drafter-eagle": 0}


def _bad_requests():
    from specdec.request.params import MAX_ID_CHARS, MAX_STOP_CHARS
    from specdec.v1 import common_pb2
    from specdec.v1.orchestrator_pb2 import GenerateRequest

    def req(**kw):
        return GenerateRequest(**{"prompt": "x", "max_new_tokens": 2, **kw})

    return [
        ("tree.value_temperature", req(tree=common_pb2.TreeParams(value_temperature=math.nan))),
        ("tree.value_temperature", req(tree=common_pb2.TreeParams(value_temperature=-0.5))),
        ("tree.value_temperature", req(tree=common_pb2.TreeParams(value_temperature=math.inf))),
        ("tree.method", req(tree=common_pb2.TreeParams(method=77))),
        ("tree.proposals", req(tree=common_pb2.TreeParams(proposals=5))),
        ("tree.depth", req(tree=common_pb2.TreeParams(depth=-1))),
        ("sampling.temperature", req(sampling=common_pb2.SamplingParams(temperature=math.nan))),
        ("sampling.top_p", req(sampling=common_pb2.SamplingParams(temperature=1.0, top_p=math.nan))),
        ("request_id", req(request_id="r" * 1_000_000)),
        ("request_id", req(request_id="r" * (MAX_ID_CHARS + 1))),
        ("request_id", req(request_id="caf\u00e9")),
        ("stop[0]", req(stop=["s" * (MAX_STOP_CHARS + 1)])),
        ("stop", req(stop=["s"] * 17)),
        ("prompt", req(prompt="")),
        ("max_new_tokens", req(max_new_tokens=-1)),
    ]


def test_every_bound_is_invalid_argument_before_any_backend(stack):
    """Raw messages (what the SDK would not build) through both RPCs: INVALID_ARGUMENT
    naming the field, no backend session opened, the server still serving."""
    from specdec.v1.orchestrator_pb2 import CompleteRequest
    from specdec.v1.orchestrator_pb2_grpc import OrchestratorServiceStub

    before = sample("specdec_requests_total", status="INVALID_ARGUMENT")
    bad = _bad_requests()
    with grpc.insecure_channel(stack.address("eagle")) as channel:
        stub = OrchestratorServiceStub(channel)
        for field, request in bad:
            for call in (lambda: stub.Complete(CompleteRequest(request=request), timeout=30),
                         lambda: list(stub.Generate(request, timeout=30))):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.value.details())
                assert err.value.details().startswith(field), (field, err.value.details())
    assert sample("specdec_requests_total", status="INVALID_ARGUMENT") - before == 2 * len(bad)
    assert stack.open_sessions("verifier", "drafter-eagle") == {"verifier": 0, "drafter-eagle": 0}
    with SpecdecClient(stack.address("eagle")) as client:
        got = client.complete("x", max_new_tokens=3, value_temperature=0.5, request_id="r" * 128)
        assert got.stats.completion_tokens == 3 and got.stats.request_id == "r" * 128


def test_verifier_down_is_unavailable(stack):
    stack.add_verifier("verifier-2")
    stack.add_orchestrator("orch-2", verifier="verifier-2")
    try:
        with SpecdecClient(stack.address("orch-2"), retries=1, backoff_s=0.01) as client:
            assert client.complete("x", max_new_tokens=2).stats.completion_tokens == 2
            stack.stop("verifier-2")
            with pytest.raises(SpecdecUnavailable) as err:
                client.complete("x", max_new_tokens=2)
            assert "verifier" in err.value.details
    finally:
        stack.stop("orch-2")


def test_not_ready_until_the_backends_answer(stack):
    stack.add_orchestrator("orch-waiting", verifier="127.0.0.1:1", connect=False)
    try:
        with SpecdecClient(stack.address("orch-waiting"), retries=0) as client:
            with pytest.raises(SpecdecUnavailable):
                client.complete("x", max_new_tokens=2)
    finally:
        stack.stop("orch-waiting")


def test_drafter_down_falls_back_to_plain_decoding(stack, local):
    stack.add_drafter("eagle-2", "eagle")
    stack.add_orchestrator("orch-3", drafter="eagle-2")
    try:
        with SpecdecClient(stack.address("orch-3")) as client:
            stack.stop("eagle-2")
            got = client.complete(PROMPTS[0], max_new_tokens=N)
        assert got.token_ids == local.run(PROMPTS[0]).tokens
        assert got.stats.draft_tokens == 0 and got.stats.tau == 1.0
        assert stack.wait_sessions_closed("verifier") == {"verifier": 0}
    finally:
        stack.stop("orch-3")


def test_bearer_token_is_required_when_configured(stack):
    stack.add_orchestrator("orch-auth", drafter="drafter-eagle", auth_token="s3cret")
    try:
        with SpecdecClient(stack.address("orch-auth")) as client:
            with pytest.raises(SpecdecUnauthenticated):
                client.complete("x", max_new_tokens=2)
        with SpecdecClient(stack.address("orch-auth"), token="wrong") as client:
            with pytest.raises(SpecdecUnauthenticated):
                list(client.generate("x", max_new_tokens=2))
        with SpecdecClient(stack.address("orch-auth"), token="s3cret") as client:
            assert client.complete("x", max_new_tokens=2).stats.completion_tokens == 2
    finally:
        stack.stop("orch-auth")


def test_metrics_count_each_request(stack):
    names = ["specdec_draft_tokens_total", "specdec_accepted_tokens_total", "specdec_drafts_total",
             "specdec_ttft_seconds_count", "specdec_request_duration_seconds_count"]
    before = {n: sample(n) for n in names}
    ok = sample("specdec_requests_total", status="OK")
    itl = sample("specdec_inter_token_latency_seconds_count")
    first = sample("specdec_accepted_tokens_per_position_total", position="1")
    with SpecdecClient(stack.address("eagle")) as client:
        s = client.complete(LONG_PROMPT, max_new_tokens=N).stats
    after = {n: sample(n) for n in names}
    assert after["specdec_draft_tokens_total"] - before["specdec_draft_tokens_total"] == s.draft_tokens > 0
    assert after["specdec_accepted_tokens_total"] - before["specdec_accepted_tokens_total"] == s.accepted_tokens
    # A cycle with one token left to generate skips the drafter.
    assert s.cycles - 1 <= after["specdec_drafts_total"] - before["specdec_drafts_total"] <= s.cycles
    assert after["specdec_ttft_seconds_count"] == before["specdec_ttft_seconds_count"] + 1
    assert after["specdec_request_duration_seconds_count"] == before["specdec_request_duration_seconds_count"] + 1
    assert sample("specdec_requests_total", status="OK") == ok + 1
    assert sample("specdec_accepted_tokens_per_position_total", position="1") - first == (
        s.accepted_per_position[0] if s.accepted_per_position else 0)
    assert 0 < sample("specdec_inter_token_latency_seconds_count") - itl < N   # tokens after the first chunk


@pytest.mark.parametrize("kind,method", [("eagle", "eagle2"), ("draft-lm", "chain")])
def test_trees_cut_by_the_verifier_match_in_process_through_the_services(tiny_family, local, kind, method,
                                                                         monkeypatch):
    s = Stack(tiny_family)
    try:
        _, servicer = s.add_verifier("verifier")
        servicer.engine.sizer = CutTo(5)
        s.add_drafter("drafter", kind)
        s.add_orchestrator("cut", drafter="drafter")
        monkeypatch.setattr(local.verifier, "sizer", CutTo(5))
        with SpecdecClient(s.address("cut")) as client:
            for prompt in PROMPTS:
                got = client.complete(prompt, max_new_tokens=N, method=method)
                spec = local.run(prompt, kind, method)
                assert got.token_ids == spec.tokens == local.run(prompt).tokens
                # the same cut trees: the accepted nodes came back in the drafted trees' numbering
                assert got.stats.cycles == spec.stats.cycles
                assert got.stats.accepted_per_position == spec.stats.accepted_per_position
                assert got.stats.draft_tokens == spec.stats.drafted <= 4 * spec.stats.cycles
        assert not servicer.engine.sizer.sessions            # every session forgotten with its release
    finally:
        s.close()
