"""Hypothesis strategies over the fields of every specdec.v1 request message.

Each scalar strategy mixes the values a bound check must get right (0, -1,
the int32 extremes, the vocabulary and context edges, NaN, +-inf, the
smallest float32) with arbitrary ones. Message strategies draw every field;
where a call only reaches its deeper checks with a live session or a tree
rooted at the session's last token, the strategy draws a *choice* the test
resolves at run time (``SessionChoice``, ``tree_root_ok``), since the live
values exist only on the server.
"""

from __future__ import annotations

import math
import re

import grpc

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from specdec.v1 import common_pb2, orchestrator_pb2

# Reproducible in CI: the same examples on every run, no example database.
FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])


def examples(n: int) -> settings:
    """FUZZ with ``n`` examples (tuned so the whole suite stays well under a minute)."""
    return settings(FUZZ, max_examples=n)


VOCAB = 300                      # tests/tiny.py's vocabulary (checked by the fixtures)
CONTEXT = 512                    # its max_position_embeddings
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
ALLOWED = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "OUT_OF_RANGE"}

int32s = st.one_of(st.integers(-3, 40), st.sampled_from([INT32_MIN, -1, INT32_MAX, VOCAB - 1, VOCAB, CONTEXT,
                                                           CONTEXT + 1, 4096]),
                   st.integers(INT32_MIN, INT32_MAX))
int64s = st.one_of(st.integers(-2, 64), st.sampled_from([-2**63, 2**63 - 1, 2**31, 48]),
                   st.integers(-2**63, 2**63 - 1))
float32s = st.one_of(st.floats(-2.0, 2.0, width=32), st.sampled_from([0.0, -0.0, math.nan, math.inf, -math.inf,
                                                                      1e-45, 3.4e38, 1.0]),
                     st.floats(width=32))
token_ids = st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([-1, VOCAB, INT32_MAX, INT32_MIN]))
short_text = st.text(max_size=24)
texts = st.one_of(short_text, st.sampled_from(["", " ", "\x00", "\ud7ff" * 3, "def f():\n" * 40]))
enum_values = st.one_of(st.integers(-1, 8), st.integers(INT32_MIN, INT32_MAX))


@st.composite
def any_sampling_params(draw) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=draw(float32s), top_k=draw(int32s), top_p=draw(float32s))
    seed = draw(st.none() | st.integers(0, 2**64 - 1))
    if seed is not None:
        msg.seed = seed
    return msg


@st.composite
def valid_sampling_params(draw) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=draw(st.sampled_from([0.0, 0.7, 1.0, 1.5])),
                                    top_k=draw(st.integers(0, 20)), top_p=draw(st.sampled_from([0.0, 0.5, 0.9, 1.0])))
    if draw(st.booleans()):
        msg.seed = draw(st.integers(0, 2**64 - 1))
    return msg


@st.composite
def any_tree_params(draw) -> common_pb2.TreeParams:
    return common_pb2.TreeParams(method=draw(enum_values), total_tokens=draw(int32s), depth=draw(int32s),
                                 expand_k=draw(int32s), value_temperature=draw(float32s),
                                 proposals=draw(enum_values))


@st.composite
def valid_tree_params(draw) -> common_pb2.TreeParams:
    return common_pb2.TreeParams(method=draw(st.sampled_from(common_pb2.TreeMethod.values())),
                                 total_tokens=draw(st.integers(0, 70)), depth=draw(st.integers(0, 10)),
                                 expand_k=draw(st.integers(0, 12)),
                                 value_temperature=draw(st.sampled_from([0.0, 0.05, 1.0, 3.0])),
                                 proposals=draw(st.sampled_from(common_pb2.Proposals.values())))


# Half the draws within the documented bounds, so the calls get past the first
# check and into the engines; half anything at all.
def sampling_params() -> st.SearchStrategy:
    return st.one_of(valid_sampling_params(), any_sampling_params())


def tree_params() -> st.SearchStrategy:
    return st.one_of(valid_tree_params(), any_tree_params())


@st.composite
def tensors(draw) -> common_pb2.Tensor:
    shape = draw(st.lists(int64s, max_size=3))
    data = draw(st.binary(max_size=64))
    return common_pb2.Tensor(data=data, dtype=draw(st.sampled_from(["float32", "float16", "bfloat16", "", "int8"])
                                                   | short_text), shape=shape)


@st.composite
def draft_trees(draw) -> common_pb2.DraftTree:
    """Trees from well-formed (each parent before its child) to arbitrary."""
    n = draw(st.integers(0, 10))
    tokens = draw(st.lists(token_ids, min_size=n, max_size=n))
    if draw(st.booleans()):
        parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    else:
        parents = draw(st.lists(int32s, max_size=n + 1))
    values = draw(st.sampled_from([[], None]) | st.lists(float32s, max_size=n + 1))
    if values is None:
        values = sorted(draw(st.lists(st.floats(-20, 0, width=32), min_size=n, max_size=n)), reverse=True)
    proposals = draw(st.lists(st.builds(common_pb2.Proposal, node=int32s, tokens=st.lists(token_ids, max_size=4),
                                        probs=st.lists(float32s, max_size=4)), max_size=2))
    return common_pb2.DraftTree(tokens=tokens, parents=parents, values=values, proposals=proposals)


# A session id the test resolves at run time: a live session's, one never
# opened, the empty string or a long string.
SESSION_CHOICES = ("live", "unknown", "empty", "long")
session_choices = st.sampled_from(SESSION_CHOICES)
# Tensor choice the test resolves at run time: features of the right shape for
# the call, or an arbitrary Tensor message.
feature_choices = st.one_of(st.just("right"), st.just("none"), tensors())


@st.composite
def generate_requests(draw):
    """Public GenerateRequest: a well-formed request with some of its fields (none,
    a few or all) replaced by arbitrary values; max_new_tokens mostly small (a
    generation costs time)."""
    fields = {
        "prompt": (st.sampled_from(["def f(x):", "for i in range(3):\n", "import os\n"]), texts),
        "max_new_tokens": (st.integers(1, 6), st.one_of(st.sampled_from([0, -1, INT32_MIN, INT32_MAX, 2048, 2049, 600]),
                                                        int32s)),
        "sampling": (valid_sampling_params(), any_sampling_params()),
        "stop": (st.sampled_from([[], ["\n\n"], ["return"]]), st.lists(texts, max_size=3)),
        "tree": (valid_tree_params(), any_tree_params()),
        "request_id": (st.sampled_from(["", "fuzz"]), st.one_of(short_text, st.sampled_from(["r" * 10_000]))),
    }
    fuzzed = draw(st.sets(st.sampled_from(sorted(fields))))
    values = {name: draw(arbitrary if name in fuzzed else valid) for name, (valid, arbitrary) in fields.items()}
    return orchestrator_pb2.GenerateRequest(**values)


def field_names(descriptor) -> set[str]:
    """Every field name of a message type and of the messages it contains."""
    names = set()
    for f in descriptor.fields:
        names.add(f.name)
        if f.message_type is not None and f.message_type is not descriptor:
            names |= field_names(f.message_type)
    return names


def names_a_field(details: str, descriptor) -> bool:
    return any(re.search(rf"\b{re.escape(name)}\b", details) for name in field_names(descriptor))


def public_violation(request, max_new_tokens_limit: int) -> str | None:
    """The field of a GenerateRequest outside its documented bounds (orchestrator.proto,
    common.proto), or None. Such a request must be answered INVALID_ARGUMENT."""
    s, t = request.sampling, request.tree
    checks = [
        ("prompt", request.prompt == ""),
        ("max_new_tokens", not 0 <= request.max_new_tokens <= max_new_tokens_limit),
        ("temperature", not (s.temperature >= 0 and math.isfinite(s.temperature))),
        ("top_p", not 0 <= s.top_p <= 1),
        ("top_k", s.top_k < 0),
        ("stop", any(stop == "" for stop in request.stop)),
        ("method", t.method not in common_pb2.TreeMethod.values()),
        ("proposals", t.proposals not in common_pb2.Proposals.values()),
        ("total_tokens", t.total_tokens < 0),
        ("depth", t.depth < 0),
        ("expand_k", t.expand_k < 0),
        ("value_temperature", not (t.value_temperature >= 0 and math.isfinite(t.value_temperature))),
    ]
    return next((name for name, bad in checks if bad), None)


def answer_of(call, request, timeout: float = 60.0) -> tuple[str, str]:
    """(status code name, details) of one unary call, or of a stream read to its end."""
    try:
        result = call(request, timeout=timeout)
        if not hasattr(result, "ListFields"):        # a stream
            for _ in result:
                pass
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or ""
    return "OK", ""


def assert_documented(answer: tuple[str, str], request, field_named: bool = True) -> None:
    """Only documented codes; INVALID_ARGUMENT names a field of the request
    (``field_named``)."""
    code, details = answer
    shown = str(request)[:1500]
    assert code in ALLOWED, f"{code}: {details}\nfor {type(request).__name__}:\n{shown}"
    if code == "INVALID_ARGUMENT" and field_named:
        assert names_a_field(details, request.DESCRIPTOR), \
            f"INVALID_ARGUMENT without a field name: {details!r}\nfor {type(request).__name__}:\n{shown}"
