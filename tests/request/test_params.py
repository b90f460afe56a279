"""specdec.request.params: every bound once, each violation an InvalidArgument naming
the field as a client writes it; the one list of methods; requests resolved
against server defaults and limits."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from specdec.request import knobs
from specdec.request.errors import InvalidArgument
from specdec.request.params import (LOOKAHEAD, MAX_ID_CHARS, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PROMPT_CHARS, MAX_STOP_CHARS,
                                    MAX_STOP_STRINGS, METHODS, PROPOSALS, REQUEST_METHODS, VANILLA, GenerationRequest,
                                    SamplingParams, TreeParams, TreeRequest, check_count, check_session_id,
                                    is_request_id)

NAN, INF = math.nan, math.inf


def rejects(build, field: str) -> str:
    with pytest.raises(InvalidArgument) as err:
        build()
    message = str(err.value)
    assert any(message.startswith(field + end) for end in (" ", ":", "[")), message
    return message


# -- sampling ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, value", [
    ("temperature", NAN), ("temperature", INF), ("temperature", -0.5), ("temperature", "1"),
    ("top_p", NAN), ("top_p", INF), ("top_p", -0.1), ("top_p", 0.0), ("top_p", 1.0001),
    ("top_k", -1), ("top_k", 2.5), ("top_k", True),
    ("seed", -1), ("seed", 2**64), ("seed", 1.5),
])
def test_sampling_bounds(name, value):
    params = SamplingParams(**{name: value})
    rejects(lambda: params.validate("sampling"), f"sampling.{name}")
    rejects(lambda: GenerationRequest("x", sampling=params), f"sampling.{name}")


def test_sampling_accepts_its_whole_range():
    for params in (SamplingParams(), SamplingParams(temperature=1e-6, top_k=1, top_p=1e-9, seed=0),
                   SamplingParams(temperature=100.0, top_k=10**6, top_p=1.0, seed=2**64 - 1)):
        assert params.validate() is params


@pytest.mark.parametrize("bias, words", [
    ({"5": 1.0}, "token id '5' must be an integer >= 0"), ({1.5: 1.0}, "token id 1.5"),
    ({-1: 1.0}, "token id -1 must be an integer >= 0"), ({True: 1.0}, "token id True"),
    ({3: 100.5}, "[3] must be in [-100, 100], got 100.5"), ({3: -101}, "[3] must be in [-100, 100]"),
    ({3: NAN}, "[3] must be in [-100, 100], got nan"), ({3: INF}, "[3]"), ({3: "1"}, "[3]"),
    (((3, 1.0), (3, 2.0)), "token id 3 is given twice"), (((3, 1.0, 2.0),), "must map token ids to biases"),
    ({i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, f"at most {MAX_LOGIT_BIAS} token ids, got {MAX_LOGIT_BIAS + 1}"),
    (7, "must map token ids to biases"), (((3, [1.0]),), "must map token ids to biases"),
])
def test_logit_bias_bounds(bias, words):
    params = SamplingParams(logit_bias=bias)
    assert words in rejects(lambda: params.validate("sampling"), "sampling.logit_bias")
    rejects(lambda: GenerationRequest("x", sampling=params), "sampling.logit_bias")


def test_logit_bias_accepts_its_range_as_sorted_pairs():
    params = SamplingParams(logit_bias={9: 100, 2: -100.0, 0: 0.5}).validate()
    assert params.logit_bias == ((0, 0.5), (2, -100.0), (9, 100))
    assert params == SamplingParams(logit_bias=[(2, -100.0), (9, 100), [0, 0.5]])
    assert SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS)}).validate()
    assert params.without_penalties().logit_bias == params.logit_bias      # it reads no history
    assert not params.penalized


def test_logit_bias_ids_are_bounded_by_the_vocabulary():
    params = SamplingParams(logit_bias={3: 1.0, 10: 1.0})
    assert params.check_vocabulary(11, "sampling") is params
    message = rejects(lambda: params.check_vocabulary(10, "sampling"), "sampling.logit_bias")
    assert "token id 10 is outside the vocabulary [0, 10)" in message


def test_prompt_only_and_prompt_logprobs_bounds():
    rejects(lambda: GenerationRequest("x", prompt_logprobs=MAX_LOGPROBS + 1), "prompt_logprobs")
    rejects(lambda: GenerationRequest("x", prompt_logprobs=-1), "prompt_logprobs")
    rejects(lambda: GenerationRequest("x", prompt_only=True, max_new_tokens=3), "max_new_tokens")
    rejects(lambda: GenerationRequest("x", prompt_only=True, n=2), "n")
    rejects(lambda: GenerationRequest("x", prompt_only=1), "prompt_only")
    req = GenerationRequest("x", prompt_only=True, prompt_logprobs=MAX_LOGPROBS)
    assert (req.max_new_tokens, req.n, req.prompt_logprobs) == (0, 1, MAX_LOGPROBS)


# -- tree knobs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name, value", [
    ("method", "beam"), ("method", VANILLA),            # resolved knobs never say vanilla: that is "no tree"
    ("proposals", "greedy"),
    ("total_tokens", 0), ("depth", -1), ("expand_k", 2.5), ("depth", True),
    ("value_temperature", 0.0), ("value_temperature", -1.0), ("value_temperature", NAN),
    ("value_temperature", INF), ("value_temperature", True),
    ("static_shape", ((0, 0),)), ("static_shape", ()),
])
def test_tree_params_bounds(name, value):
    rejects(lambda: TreeParams(**{name: value}), name)


@pytest.mark.parametrize("name, value", [
    ("method", "beam"), ("proposals", "greedy"),
    ("total_tokens", -1), ("depth", -3), ("expand_k", -1), ("expand_k", 1.5),
    ("value_temperature", -1.0), ("value_temperature", NAN), ("value_temperature", INF),
])
def test_tree_request_bounds(name, value):
    message = rejects(lambda: TreeRequest(**{name: value}), f"tree.{name}")
    if name == "value_temperature":
        assert message.startswith("tree.value_temperature must be >= 0")


def test_tree_request_resolves_against_defaults_and_limits():
    default = TreeParams(method="eagle2", total_tokens=12, depth=4, expand_k=3, proposals="top",
                         value_temperature=0.7)
    limits = TreeParams(total_tokens=20, depth=5, expand_k=4)
    assert TreeRequest().resolve(default) == default
    assert TreeRequest(method=VANILLA, depth=3).resolve(default, limits) is None
    got = TreeRequest(method="chain", total_tokens=500, depth=2, expand_k=99, value_temperature=2.0,
                      proposals="sampled").resolve(default, limits)
    assert got == TreeParams(method="chain", total_tokens=20, depth=2, expand_k=4, value_temperature=2.0,
                             proposals="sampled")
    assert TreeRequest(proposals="auto").resolve(default).proposals == "top"     # auto: the server's default
    shaped = TreeParams(method="static", static_shape=((0,), (1,), (0, 0)))
    assert TreeRequest().resolve(shaped).static_shape == ((0,), (1,), (0, 0))
    assert TreeRequest(method="eagle2").resolve(shaped).static_shape is None   # another method: no shape


# -- whole requests and ids ----------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, "prompt"),
    ({"prompt": b"x"}, "prompt"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": 1.5}, "max_new_tokens"),
    ({"stop": ("",)}, "stop[0]"),
    ({"stop": ("ok", "x" * (MAX_STOP_CHARS + 1))}, "stop[1]"),
    ({"stop": ("s",) * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"request_id": "r" * (MAX_ID_CHARS + 1)}, "request_id"),
    ({"request_id": "r" * 1_000_000}, "request_id"),
    ({"request_id": "caf\u00e9"}, "request_id"),
    ({"request_id": "a\nb"}, "request_id"),
])
def test_generation_request_bounds(kwargs, field):
    rejects(lambda: GenerationRequest(**{"prompt": "x", **kwargs}), field)


def test_generation_request_accepts_its_bounds():
    req = GenerationRequest("x" * MAX_PROMPT_CHARS, max_new_tokens=0, stop=["a", "b" * MAX_STOP_CHARS],
                            request_id="r" * MAX_ID_CHARS)
    assert req.stop == ("a", "b" * MAX_STOP_CHARS)                       # a tuple: the request is frozen
    assert is_request_id("abc-123 ~") and not is_request_id("") and not is_request_id(None)


@pytest.mark.parametrize("value", ["", "s" * (MAX_ID_CHARS + 1), 7])
def test_session_id_bounds(value):
    rejects(lambda: check_session_id(value), "session_id")


def test_counts_say_what_zero_means():
    assert check_count(0, "count") == 0
    assert "(0 = server default)" in rejects(lambda: check_count(-1, "depth", note="0 = server default"), "depth")


# -- one list of methods -------------------------------------------------------------------------
def test_one_method_list_everywhere():
    from specdec.request import wire
    from specdec.client import sdk
    from specdec.v1 import common_pb2

    assert REQUEST_METHODS == METHODS + (LOOKAHEAD, VANILLA) and knobs.DEFAULT_METHOD in METHODS
    assert sdk.METHODS == REQUEST_METHODS and sdk.PROPOSALS == PROPOSALS
    assert tuple(wire.METHOD_TO_PROTO) == REQUEST_METHODS and tuple(wire.PROPOSALS_TO_PROTO) == PROPOSALS
    # the proto has no method or mode the list lacks
    assert set(common_pb2.TreeMethod.values()) == set(wire.METHOD_FROM_PROTO) | {common_pb2.TREE_METHOD_UNSPECIFIED}
    assert set(common_pb2.Proposals.values()) == set(wire.PROPOSALS_FROM_PROTO)


def test_parameter_layer_imports_no_torch():
    code = ("import sys, specdec.request.params, specdec.request.wire, specdec.client, orchestrator.service; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
