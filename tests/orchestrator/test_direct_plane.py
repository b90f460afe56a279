"""The direct plane (``orchestrator.plane``, ``verifier.plane``, ``verifier.paired``):
the verifier runs each request's loop and talks to the paired drafter itself.

Real gRPC on 127.0.0.1 (tiny family): output token-identical to in-process
decoding, greedy and seeded sampled (penalties, logprobs); stops, cancels and
deadlines end the run and free both sessions; a drafter lost mid-run leaves
plain decoding with the same output; a verifier lost mid-run is resumed on
another from the committed tokens; bad policies are INVALID_ARGUMENT naming
the field; the hops on a cycle's critical path are what the Run stream says.
"""

import asyncio
import time

import grpc
import pytest

from running_stack import Stack, Tap
from serving.helpers import SessionWatch, drafter_builder, verifier_builder
from specdec.client import SpecdecClient, SpecdecDeadlineExceeded
from specdec.request import wire
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from specdec.serving.metrics import REGISTRY
from specdec.serving.server import ClientTls, open_channel
from specdec.v1 import common_pb2, verifier_pb2
from specdec.v1.verifier_pb2_grpc import VerifierServiceStub
from test_routing import Background, add_orchestrator, wait_for

PROMPTS = ["def add(a, b):", "for i in range(3):\n"]
LONG_PROMPT = "class Point:"
N = 24
KINDS = ("eagle", "draft-lm", "ngram")


@pytest.fixture(scope="module")
def stack(tiny_family):
    s = Stack(tiny_family)
    s.add_verifier("verifier")
    s.add_orchestrator("none", plane="direct")
    for kind in KINDS:
        s.add_drafter(f"drafter-{kind}", kind)
        s.add_orchestrator(kind, drafter=f"drafter-{kind}", plane="direct")
    s.add_drafter("oracle", "oracle")
    s.add_orchestrator("ahead", drafter="oracle", plane="direct", lookahead=3, lookahead_budget=False)
    s.add_orchestrator("ahead-budgeted", drafter="oracle", plane="direct", lookahead=3)
    yield s
    s.close()


class Reference:
    """In-process engines over the same weights."""

    def __init__(self, paths):
        from specdec.model.loading import load_tokenizer

        self.verifier = verifier_builder(paths)()
        self.drafters = {kind: drafter_builder(paths, kind)() for kind in KINDS}
        self.tok = load_tokenizer(paths["target"])

    def run(self, prompt, kind=None, method=None, n=N, proposals="auto", **sampling):
        from specdec.local import generate

        ids = self.tok(prompt, add_special_tokens=True)["input_ids"]
        stop = StopCriteria(max_new_tokens=n, eos_ids=frozenset([self.tok.eos_token_id]))
        cfg = TreeParams(method=method, proposals=proposals) if method not in (None, "vanilla") else None
        return generate(self.verifier, self.drafters.get(kind), ids, SamplingParams(**sampling), stop, cfg)


@pytest.fixture(scope="module")
def reference(tiny_family):
    return Reference(tiny_family)


def sample(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("kind,method", [("none", "vanilla"), ("eagle", "eagle2"), ("eagle", "static"),
                                         ("eagle", "vanilla"), ("draft-lm", "chain"), ("ngram", "eagle2"),
                                         ("none", "lookahead")])
def test_greedy_matches_plain_decoding(stack, reference, kind, method):
    with SpecdecClient(stack.address(kind)) as client:
        for prompt in PROMPTS:
            got = client.complete(prompt, max_new_tokens=N, method=method)
            assert got.token_ids == reference.run(prompt).tokens
            assert got.stats.completion_tokens == N and got.stats.finish_reason == "length"
    assert stack.wait_sessions_closed("verifier", *(f"drafter-{k}" for k in KINDS)) == {
        "verifier": 0, **{f"drafter-{k}": 0 for k in KINDS}}


def test_greedy_sessions_paired_with_one_drafter_share_its_pace(stack, reference):
    """On the direct plane the verifier keys what cycles cost by the paired
    drafter: a greedy session joining a pair where drafting lost starts paused,
    with plain decoding's output."""
    stack.add_orchestrator("paced", drafter="drafter-eagle", plane="direct", min_tau=1.5)
    paces = stack.servicer("verifier").paces.table
    paces.clear()                                 # what the module's earlier sessions measured
    try:
        with SpecdecClient(stack.address("paced")) as client:
            first = client.complete(PROMPTS[1], max_new_tokens=N, method="eagle2")
            assert first.stats.draft_tokens > 0
            pace = next(p for key, p in paces.items() if key[0] == stack.address("drafter-eagle"))
            pace.seconds, pace.tokens, pace.pause = {True: 0.04, False: 0.01}, 1.5, 64
            joined = client.complete(PROMPTS[1], max_new_tokens=N, method="eagle2")
    finally:
        stack.stop("paced")
    assert joined.token_ids == first.token_ids == reference.run(PROMPTS[1]).tokens
    assert joined.stats.draft_tokens == 0 and joined.stats.cycles == N - 1


def test_draft_lm_trees_are_accepted_and_counted(stack, reference):
    """A drafter that drafts: cycles commit several tokens, the statistics say so."""
    with SpecdecClient(stack.address("draft-lm")) as client:
        got = client.complete(PROMPTS[0], max_new_tokens=N, method="chain")
    local = reference.run(PROMPTS[0], "draft-lm", "chain")
    assert got.token_ids == local.tokens
    assert got.stats.cycles == local.stats.cycles and got.stats.tau == pytest.approx(local.stats.tau)
    assert got.stats.draft_tokens == local.stats.drafted and got.stats.draft_tokens > 0


@pytest.mark.parametrize("params", [
    dict(temperature=0.75, top_p=0.875, top_k=50, seed=7),
    dict(temperature=0.9, seed=11, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.2),
])
def test_seeded_sampling_matches_in_process(stack, reference, params):
    with SpecdecClient(stack.address("eagle")) as client:
        drawn = client.complete(PROMPTS[0], max_new_tokens=N, **params)
        top = client.complete(PROMPTS[0], max_new_tokens=N, proposals="top", **params)
    assert drawn.token_ids == reference.run(PROMPTS[0], "eagle", "eagle2", **params).tokens
    assert top.token_ids == reference.run(PROMPTS[0], "eagle", "eagle2", proposals="top", **params).tokens


def test_logprobs_match_the_relayed_loop(stack):
    stack.add_orchestrator("relay-eagle", drafter="drafter-eagle")
    try:
        got = {}
        for name in ("eagle", "relay-eagle"):
            with SpecdecClient(stack.address(name)) as client:
                got[name] = client.complete(PROMPTS[1], max_new_tokens=12, logprobs=3, prompt_logprobs=2,
                                            temperature=0.8, seed=5)
    finally:
        stack.stop("relay-eagle")
    direct, relay = got["eagle"], got["relay-eagle"]
    assert direct.token_ids == relay.token_ids
    assert len(direct.logprobs) == len(direct.token_ids) and direct.logprobs == relay.logprobs
    assert direct.prompt_logprobs and direct.prompt_logprobs == relay.prompt_logprobs


def test_stop_strings_end_the_output_before_them(stack):
    with SpecdecClient(stack.address("eagle")) as client:
        full = client.complete(LONG_PROMPT, max_new_tokens=40)
        text = full.text
        stop = text[len(text) // 2:len(text) // 2 + 3]
        cut = text.index(stop)
        got = client.complete(LONG_PROMPT, max_new_tokens=40, stop=[stop])
        streamed = list(client.generate(LONG_PROMPT, max_new_tokens=40, stop=[stop]))
    assert got.text == text[:cut] and got.stats.finish_reason == "stop"
    assert got.token_ids == full.token_ids[:len(got.token_ids)]
    assert "".join(c.text for c in streamed) == got.text
    assert stack.wait_sessions_closed("verifier", "drafter-eagle") == {"verifier": 0, "drafter-eagle": 0}


def test_cancel_frees_both_sessions(stack):
    watch = SessionWatch(stack, "verifier", "drafter-eagle")
    with SpecdecClient(stack.address("eagle")) as client:
        stream = client.generate(LONG_PROMPT, max_new_tokens=400)
        next(stream)
        assert watch.opened(1) == {"verifier": 1, "drafter-eagle": 1}
        stream.close()
        assert watch.released() == {"verifier": 0, "drafter-eagle": 0}


def test_deadline_exceeded_frees_both_sessions(stack):
    watch = SessionWatch(stack, "verifier", "drafter-eagle")
    verifies = Tap(stack.servicer("verifier").engine, "verify")
    try:
        with SpecdecClient(stack.address("eagle")) as client:
            with pytest.raises(SpecdecDeadlineExceeded):
                client.complete(LONG_PROMPT, max_new_tokens=400, timeout=0.3)
        assert watch.released() == {"verifier": 0, "drafter-eagle": 0}
    finally:
        verifies.restore()
    assert len(verifies.sessions) < 200            # cut short


def test_drafter_lost_mid_run_goes_on_as_plain_decoding(stack, reference):
    stack.add_drafter("lost", "eagle")
    stack.add_orchestrator("orch-lost", drafter="lost", plane="direct")
    drafts = Tap(stack.servicer("lost").drafter, "draft")
    try:
        drafts.close(after=3)
        with SpecdecClient(stack.address("orch-lost"), timeout=60) as client:
            gen = Background(client, LONG_PROMPT, max_new_tokens=N)
            wait_for(lambda: drafts.held, what="a draft held in the drafter")
            stack.stop("lost")                      # mid-step: the verifier's stream to it breaks
            drafts.open()
            got = gen.result()
        assert got.token_ids == reference.run(LONG_PROMPT).tokens
        assert got.stats.completion_tokens == N
        assert stack.wait_sessions_closed("verifier") == {"verifier": 0}
    finally:
        drafts.restore()
        stack.stop("orch-lost")


@pytest.mark.timeout(120)
def test_verifier_lost_mid_run_resumes_elsewhere(stack, reference):
    for name in ("rv1", "rv2"):
        stack.add_verifier(name)
    stack.add_drafter("rd", "eagle")
    add_orchestrator(stack, "ro", ["rv1", "rv2"], ["rd"], plane="direct")
    taps = {n: Tap(stack.servicer(n).engine, "verify") for n in ("rv1", "rv2")}
    moved = sample("specdec_failovers_total", role="verifier")
    try:
        for tap in taps.values():
            tap.close(after=5)
        with SpecdecClient(stack.address("ro"), timeout=60) as client:
            gen = Background(client, LONG_PROMPT, max_new_tokens=N)
            wait_for(lambda: any(t.held for t in taps.values()), what="a verify held")
            victim = next(n for n, t in taps.items() if t.held)
            other = next(n for n in taps if n != victim)
            stack.stop(victim)
            for tap in taps.values():
                tap.open()
            got = gen.result()
        assert got.token_ids == reference.run(LONG_PROMPT).tokens
        assert got.stats.completion_tokens == N and got.stats.finish_reason == "length"
        assert sample("specdec_failovers_total", role="verifier") == moved + 1
        assert taps[other].sessions
        assert stack.wait_sessions_closed(other, "rd") == {other: 0, "rd": 0}
    finally:
        for tap in taps.values():
            tap.restore()
        for name in ("ro", "rv1", "rv2", "rd"):
            if name in stack.servers:
                stack.stop(name)


def run_start(stack, reference, drafter=None, **policy):
    ids = reference.tok(PROMPTS[0], add_special_tokens=True)["input_ids"]
    prefill = verifier_pb2.VerifierPrefillRequest(session_id=f"run-{time.monotonic_ns()}", prompt_ids=ids,
                                                  sampling=common_pb2.SamplingParams(), max_new_tokens=N)
    start = verifier_pb2.RunStart(prefill=prefill, drafter=stack.address(drafter) if drafter else "", **policy)
    return verifier_pb2.RunRequest(start=start)


def run_events(address, *messages):
    """The events of one Run call sending ``messages``."""
    async def run():
        async with open_channel(address) as channel:
            call = VerifierServiceStub(channel).Run(iter(messages), timeout=60)
            return [event async for event in call]

    return asyncio.run(run())


def test_run_stream_reports_each_commit_and_its_hops(stack, reference):
    tree = wire.tree_params_to_proto(TreeParams(method="chain"))
    events = run_events(stack.address("verifier"),
                              run_start(stack, reference, "drafter-draft-lm", tree=tree))
    commits, done = [e.commit for e in events[:-1]], events[-1].done
    assert all(e.WhichOneof("step") == "commit" for e in events[:-1]) and events[-1].WhichOneof("step") == "done"
    assert [t for c in commits for t in c.tokens] == reference.run(PROMPTS[0]).tokens
    assert commits[0].nodes == 0 and commits[0].hops == 0          # the prefill
    drafted = [c for c in commits[1:] if c.nodes > 1]
    assert drafted and all(c.hops == 2 for c in drafted)           # a fresh tree: its commits out, the tree back
    assert all(c.hops == 0 for c in commits[1:] if c.nodes == 1)   # a root-only cycle (the last token) asks nobody
    assert done.drafts == len(drafted) and done.finish_reason == "length" and not done.fallback
    assert stack.wait_sessions_closed("verifier", "drafter-draft-lm") == {"verifier": 0, "drafter-draft-lm": 0}


def test_waiting_on_the_drafter_splits_into_its_compute_and_the_transport(stack, reference, monkeypatch):
    """A commit's draft time is the drafter's compute; the rest of the wait on
    it (here 50 ms more before every tree goes back) is network time in the
    request's split, as on the relay plane."""
    from drafter.service import DrafterService

    delay, answered = 0.05, []
    draft = DrafterService.Draft

    async def slow(self, request, context):
        answer = await draft(self, request, context)
        await asyncio.sleep(delay)
        answered.append(answer.compute_s)
        return answer

    monkeypatch.setattr(DrafterService, "Draft", slow)
    with SpecdecClient(stack.address("draft-lm")) as client:
        got = client.complete(PROMPTS[0], max_new_tokens=N, method="chain")
    assert got.token_ids == reference.run(PROMPTS[0]).tokens
    s = got.stats
    assert len(answered) >= 2
    assert s.network_s >= delay * len(answered)
    assert sum(answered) <= s.draft_s < sum(answered) + delay        # compute, and the prefill's own step


def test_drafting_ahead_hits_skip_the_drafter(stack, reference):
    """Greedy, drafting ahead on the direct plane with a drafter that is always
    right: every cycle after the first finds its tree ready (no hop), the output
    is plain decoding's."""
    with SpecdecClient(stack.address("ahead")) as client:
        got = client.complete(PROMPTS[0], max_new_tokens=40, method="chain", total_tokens=6, depth=5)
    assert got.token_ids == reference.run(PROMPTS[0], n=40).tokens
    s = got.stats
    assert s.tau > 5.0 and s.ahead_hits == s.cycles - 1, s
    assert 0 < s.ahead_committed < s.completion_tokens


def test_drafting_ahead_is_budgeted_to_the_verify_as_the_loop_waits_for_it(stack, reference, monkeypatch):
    """A DraftAhead may take ``AHEAD_BUDGET_SHARE`` of the last verify's wall
    time in the verifier's loop (the forward, the handler's checks and its
    hand-overs: what the drafting hides behind), not of the forward alone."""
    from verifier import paired, plane

    verifies, budgets = [], []
    verify, draft_ahead = plane.ServedVerifier.verify, paired.PairedDrafter.draft_ahead

    async def timed_verify(self, draft, features):
        handler, computed = self.service.Verify, []

        async def computing(request, context):
            answer = await handler(request, context)
            computed.append(answer.compute_s)
            return answer

        self.service.Verify, start = computing, time.perf_counter()
        try:
            got = await verify(self, draft, features)
        finally:
            del self.service.Verify                    # the class's handler again
        verifies.append((computed[0], time.perf_counter() - start))
        return got

    async def budgeted(self, *args, **kwargs):
        budgets.append((self.ahead_budget(), verifies[-1] if verifies else None))
        return await draft_ahead(self, *args, **kwargs)

    monkeypatch.setattr(plane.ServedVerifier, "verify", timed_verify)
    monkeypatch.setattr(paired.PairedDrafter, "draft_ahead", budgeted)
    with SpecdecClient(stack.address("ahead-budgeted")) as client:
        got = client.complete(PROMPTS[0], max_new_tokens=40, method="chain", total_tokens=6, depth=5)
    assert got.token_ids == reference.run(PROMPTS[0], n=40).tokens
    timed = [(budget, last) for budget, last in budgets if last is not None]
    assert len(timed) >= 2, budgets
    for budget, (compute, wall) in timed:
        assert plane.AHEAD_BUDGET_SHARE * compute < budget <= plane.AHEAD_BUDGET_SHARE * wall


@pytest.mark.parametrize("policy,field", [
    ({"lookahead": 9}, "lookahead"),
    ({"verify_token_budget": -1}, "verify_token_budget"),
    ({"min_tau": -1.0}, "min_tau"),
    ({"eos_token_ids": [10 ** 6]}, "eos_token_ids"),
    ({"tree": common_pb2.TreeParams(method=99)}, "tree.method"),
])
def test_a_bad_policy_is_invalid_argument_naming_the_field(stack, reference, policy, field):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run_events(stack.address("verifier"), run_start(stack, reference, "drafter-eagle", **policy))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
    assert stack.open_sessions("verifier") == {"verifier": 0}


def test_a_run_opens_with_start(stack, reference):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run_events(stack.address("verifier"), verifier_pb2.RunRequest(stop=verifier_pb2.RunStop()))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "start" in err.value.details()


def test_the_verifier_reaches_a_tls_drafter_with_its_peer_credentials(tiny_family, certs, reference):
    """Every backend behind TLS and a bearer token: a verifier given the peer
    credentials drafts on the paired drafter; one without them cannot reach it
    and goes on as plain decoding, the same output."""
    tls = dict(tls_cert=certs["server.pem"], tls_key=certs["server.key"], auth_token="backend-secret")
    client_tls = ClientTls(ca=certs["ca.pem"])
    s = Stack(tiny_family)
    try:
        s.add_drafter("d", "draft-lm", **tls)
        s.add_verifier("peered", peer_tls=client_tls, peer_token="backend-secret", **tls)
        s.add_verifier("unpeered", **tls)
        for name in ("peered", "unpeered"):
            s.add_orchestrator(f"o-{name}", verifier=name, drafter="d", plane="direct", backend_tls=client_tls,
                               backend_token="backend-secret")
        plain = reference.run(PROMPTS[0]).tokens
        with SpecdecClient(s.address("o-peered")) as client:
            drafted = client.complete(PROMPTS[0], max_new_tokens=N, method="chain")
        with SpecdecClient(s.address("o-unpeered")) as client:
            undrafted = client.complete(PROMPTS[0], max_new_tokens=N, method="chain")
        assert drafted.token_ids == plain and drafted.stats.draft_tokens > 0
        assert undrafted.token_ids == plain and undrafted.stats.draft_tokens == 0
        assert s.wait_sessions_closed("peered", "unpeered", "d") == {"peered": 0, "unpeered": 0, "d": 0}
    finally:
        s.close()


@pytest.mark.timeout(120)
def test_a_lost_drafter_is_replaced_and_the_run_drafts_on(stack, reference):
    """The paired EAGLE drafter stopped mid-run: the verifier says so, the
    orchestrator pairs the run with the other drafter, which is prefilled with
    every committed token and feature row and drafts the rest; the output is
    plain decoding's."""
    for name in ("pd1", "pd2"):
        stack.add_drafter(name, "eagle")
    add_orchestrator(stack, "po", ["verifier"], ["pd1", "pd2"], plane="direct")
    taps = {n: Tap(stack.servicer(n).drafter, "draft") for n in ("pd1", "pd2")}
    moved = sample("specdec_failovers_total", role="drafter")
    try:
        for tap in taps.values():
            tap.close(after=3)
        with SpecdecClient(stack.address("po"), timeout=60) as client:
            gen = Background(client, LONG_PROMPT, max_new_tokens=N)
            wait_for(lambda: any(t.held for t in taps.values()), what="a draft held")
            victim = next(n for n, t in taps.items() if t.held)
            other = next(n for n in taps if n != victim)
            drafted_before = len(taps[other].sessions)
            stack.stop(victim)
            for tap in taps.values():
                tap.open()
            got = gen.result()
        assert got.token_ids == reference.run(LONG_PROMPT).tokens
        assert got.stats.completion_tokens == N and got.stats.finish_reason == "length"
        assert sample("specdec_failovers_total", role="drafter") == moved + 1
        assert len(taps[other].sessions) > drafted_before       # the run drafted on there
        assert stack.wait_sessions_closed("verifier", other) == {"verifier": 0, other: 0}
    finally:
        for tap in taps.values():
            tap.restore()
        for name in ("po", "pd1", "pd2"):
            if name in stack.servers:
                stack.stop(name)


def test_an_auto_gate_judges_by_the_pairs_measured_break_even(stack, reference):
    """``--min-tau auto`` travels to the verifier as a prior (``RunStart.min_tau_prior``):
    on a pair whose drafted cycles commit 1.5 tokens at a measured break-even of
    1.2, a greedy session drafts at once; under an explicit 2.0 it starts paused."""
    stack.add_orchestrator("auto-gate", drafter="drafter-eagle", plane="direct", min_tau=None)
    stack.add_orchestrator("floor-gate", drafter="drafter-eagle", plane="direct", min_tau=2.0)
    paces = stack.servicer("verifier").paces.table
    got = {}
    try:
        for name in ("auto-gate", "floor-gate"):
            paces.clear()
            with SpecdecClient(stack.address(name)) as client:
                client.complete(PROMPTS[1], max_new_tokens=2, method="eagle2")         # the pair's pace exists
                pace = next(p for key, p in paces.items() if key[0] == stack.address("drafter-eagle"))
                pace.seconds, pace.tokens, pace.pause = {True: 0.012, False: 0.01}, 1.5, 64
                got[name] = client.complete(PROMPTS[1], max_new_tokens=N, method="eagle2")
    finally:
        stack.stop("auto-gate")
        stack.stop("floor-gate")
    assert got["auto-gate"].token_ids == got["floor-gate"].token_ids == reference.run(PROMPTS[1]).tokens
    assert got["auto-gate"].stats.draft_tokens > 0 and got["floor-gate"].stats.draft_tokens == 0
