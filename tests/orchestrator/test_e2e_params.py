"""The sampling parameters of issue 17 through the real services (gRPC on
127.0.0.1): penalties and min_p lossless with speculation on, logprobs equal
to the in-process engines', token-id prompts, chat messages, n choices that a
seed reproduces, and INVALID_ARGUMENT naming each bad field."""

import grpc
import pytest

from running_stack import Stack
from specdec.client import SpecdecClient, SpecdecInvalidArgument
from specdec.local import generate
from specdec.model.loading import load_tokenizer
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from specdec.v1 import common_pb2
from specdec.v1.orchestrator_pb2 import ChatMessage, CompleteRequest, GenerateRequest
from specdec.v1.orchestrator_pb2_grpc import OrchestratorServiceStub

PROMPT = "def add(a, b):"
N = 20
PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4)


@pytest.fixture(scope="module")
def stack(tiny_family):
    s = Stack(tiny_family)
    s.add_verifier("verifier")
    s.add_drafter("drafter-eagle", "eagle")
    s.add_orchestrator("eagle", drafter="drafter-eagle")
    yield s
    s.close()


@pytest.fixture(scope="module")
def local(tiny_family):
    from serving.helpers import drafter_builder, verifier_builder

    return verifier_builder(tiny_family)(), drafter_builder(tiny_family, "eagle")(), \
        load_tokenizer(tiny_family["target"])


def run_local(local, params: SamplingParams, drafter=True, logprobs=None, prompt=PROMPT):
    verifier, eagle, tok = local
    ids = tok(prompt, add_special_tokens=True)["input_ids"]
    stop = StopCriteria(max_new_tokens=N, eos_ids=frozenset([tok.eos_token_id]))
    cfg = TreeParams() if drafter else None
    return generate(verifier, eagle if drafter else None, ids, params, stop, cfg, logprobs=logprobs)


def test_greedy_with_penalties_and_min_p_matches_in_process_vanilla(stack, local):
    want = run_local(local, SamplingParams(**PENALTIES), drafter=False)
    assert want.tokens != run_local(local, SamplingParams(), drafter=False).tokens
    with SpecdecClient(stack.address("eagle")) as client:
        got = client.complete(PROMPT, max_new_tokens=N, min_p=0.1, **PENALTIES)
    assert got.token_ids == want.tokens
    assert got.stats.cycles < N        # speculation stayed on


@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.9, top_p=0.95, seed=4, **PENALTIES)])
def test_logprobs_match_in_process_for_complete_and_stream(stack, local, sampling):
    params = SamplingParams(**sampling)
    want = run_local(local, params, logprobs=3)
    with SpecdecClient(stack.address("eagle")) as client:
        got = client.complete(PROMPT, max_new_tokens=N, logprobs=3, **sampling)
        stream = client.generate(PROMPT, max_new_tokens=N, logprobs=3, **sampling)
        chunks = list(stream)
    assert got.token_ids == want.tokens == stream.token_ids
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    for entries in (got.logprobs, stream.logprobs, got.choices[0].logprobs):
        assert [e.token for e in entries] == want.tokens
        for e, w in zip(entries, want.logprobs):
            assert e.logprob == pytest.approx(w.logprob, abs=1e-5)
            assert list(e.top_tokens) == list(w.top_tokens)
            assert list(e.top_logprobs) == pytest.approx(list(w.top_logprobs), abs=1e-5)
    assert got.stats.cycles < N


def test_no_logprobs_unless_asked(stack):
    with SpecdecClient(stack.address("eagle")) as client:
        assert client.complete(PROMPT, max_new_tokens=4).logprobs == []
        assert [len(e.top_tokens) for e in client.complete(PROMPT, max_new_tokens=4, logprobs=0).logprobs] == [0] * 4


def test_token_id_prompt_equals_the_text_prompt(stack, local):
    ids = local[2](PROMPT, add_special_tokens=True)["input_ids"]
    with SpecdecClient(stack.address("eagle")) as client:
        by_text = client.complete(PROMPT, max_new_tokens=N)
        by_ids = client.complete(ids, max_new_tokens=N)
    assert by_ids.token_ids == by_text.token_ids and by_ids.text == by_text.text
    assert by_ids.stats.prompt_tokens == len(ids)


def test_chat_messages_go_through_the_renderer(stack):
    servicer = stack.servicer("eagle")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    with SpecdecClient(stack.address("eagle")) as client:
        with pytest.raises(SpecdecInvalidArgument, match="messages"):
            client.complete(messages=messages, max_new_tokens=4)
        servicer.chat_renderer = lambda msgs: "".join(f"<{m.role}>{m.content}\n" for m in msgs)
        try:
            got = client.complete(messages=messages, max_new_tokens=N)
        finally:
            servicer.chat_renderer = None
        want = client.complete(f"<system>Be brief.\n<user>{PROMPT}\n", max_new_tokens=N)
    assert got.token_ids == want.token_ids


def test_n_choices_reproduce_with_a_seed(stack):
    sampling = dict(temperature=1.0, seed=1234, max_new_tokens=N)
    with SpecdecClient(stack.address("eagle")) as client:
        first = client.complete(PROMPT, n=3, **sampling)
        again = client.complete(PROMPT, n=3, **sampling)
        single = client.complete(PROMPT, **sampling)
        stream = client.generate(PROMPT, n=3, **sampling)
        indices = {c.index for c in stream}
    runs = [c.token_ids for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert runs == [c.token_ids for c in again.choices]
    assert runs[0] == single.token_ids == first.token_ids
    assert len({tuple(r) for r in runs}) > 1                   # independent draws
    assert indices == {0, 1, 2}
    assert [stream.choices[i].token_ids for i in range(3)] == runs
    assert [stream.choices[i].stats.index for i in range(3)] == [0, 1, 2]
    assert stack.open_sessions("verifier", "drafter-eagle") == {"verifier": 0, "drafter-eagle": 0}


def _req(**kw):
    return GenerateRequest(**{"prompt": "x", "max_new_tokens": 2, **kw})


BAD = [
    ("sampling.min_p", _req(sampling=common_pb2.SamplingParams(min_p=1.5))),
    ("sampling.presence_penalty", _req(sampling=common_pb2.SamplingParams(presence_penalty=2.5))),
    ("sampling.frequency_penalty", _req(sampling=common_pb2.SamplingParams(frequency_penalty=-3.0))),
    ("sampling.frequency_penalty", _req(sampling=common_pb2.SamplingParams(frequency_penalty=float("nan")))),
    ("sampling.repetition_penalty", _req(sampling=common_pb2.SamplingParams(repetition_penalty=-1.0))),
    ("sampling.repetition_penalty", _req(sampling=common_pb2.SamplingParams(repetition_penalty=float("inf")))),
    ("logprobs", _req(logprobs=21)),
    ("logprobs", _req(logprobs=-1)),
    ("n", _req(n=17)),
    ("n", _req(n=-2)),
    ("prompt_ids[1]", _req(prompt="", prompt_ids=[5, -3])),
    ("prompt_ids[0]", _req(prompt="", prompt_ids=[10**9])),
    ("messages[0].role", _req(prompt="", messages=[ChatMessage(role="robot", content="hi")])),
    ("give one of prompt, prompt_ids", _req(prompt_ids=[5])),
]


def test_each_bad_value_is_invalid_argument_naming_the_field(stack):
    with grpc.insecure_channel(stack.address("eagle")) as channel:
        stub = OrchestratorServiceStub(channel)
        for field, request in BAD:
            for call in (lambda: stub.Complete(CompleteRequest(request=request), timeout=30),
                         lambda: list(stub.Generate(request, timeout=30))):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.value.details())
                assert err.value.details().startswith(field), (field, err.value.details())
    assert stack.open_sessions("verifier", "drafter-eagle") == {"verifier": 0, "drafter-eagle": 0}
