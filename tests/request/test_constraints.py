"""Constraints: their bounds (an InvalidArgument naming the field for every bad
or hostile value, never a hang), their gRPC twin and the SDK's keywords."""

import json

import pytest

from specdec.client.sdk import build_request
from specdec.request import wire
from specdec.request.constraints import MAX_CONSTRAINT_CHARS, Constraint, constraint_from
from specdec.request.errors import InvalidArgument
from specdec.request.params import GenerationRequest, SamplingParams
from specdec.v1 import common_pb2

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
GOOD = [Constraint("json_object"), Constraint("json_schema", json.dumps(SCHEMA)), Constraint("regex", r"[a-z]{1,8}"),
        Constraint("grammar", 'start: "yes" | "no"'),
        # recursive, but satisfiable: compiled lazily by llguidance
        Constraint("json_schema", json.dumps({"$defs": {"n": {"type": "object", "properties": {
            "c": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"})),
        Constraint("grammar", 'start: a\na: "(" a ")" | "x"')]

BAD = [
    (Constraint("xml", "x"), "sampling.constraint.kind"),
    (Constraint("json_object", "{}"), "sampling.constraint.value"),
    (Constraint("json_schema", ""), "sampling.constraint.value"),
    (Constraint("json_schema", "{not json"), "sampling.constraint.value"),
    (Constraint("json_schema", "[1, 2]"), "sampling.constraint.value"),
    (Constraint("json_schema", json.dumps({"type": "string", "minLength": 5, "maxLength": 2})),
     "sampling.constraint.value"),                                               # unsatisfiable
    (Constraint("json_schema", json.dumps({"allOf": [{"type": "string"}, {"type": "integer"}]})),
     "sampling.constraint.value"),                                               # unsatisfiable
    (Constraint("json_schema", "[" * 100_000 + "]" * 100_000), "sampling.constraint.value"),      # huge
    (Constraint("json_schema", "[" * 30_000 + "]" * 30_000), "sampling.constraint.value"),        # deep
    (Constraint("json_schema", json.dumps(eval("{'type': 'array', 'items': " * 40 + "{}" + "}" * 40))),
     "sampling.constraint.value"),                                               # nested past the limit
    (Constraint("regex", "a(b"), "sampling.constraint.value"),
    (Constraint("regex", "x" * (MAX_CONSTRAINT_CHARS + 1)), "sampling.constraint.value"),
    (Constraint("grammar", "start: undefined_rule"), "sampling.constraint.value"),
    (Constraint("regex", 5), "sampling.constraint"),
]


@pytest.mark.parametrize("constraint", GOOD, ids=lambda c: c.kind)
def test_good_constraints_validate(constraint):
    assert SamplingParams(constraint=constraint).validate("sampling").constraint == constraint


@pytest.mark.parametrize("constraint,field", BAD, ids=[f"{c.kind}-{i}" for i, (c, _) in enumerate(BAD)])
def test_bad_constraints_name_their_field(constraint, field):
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(constraint=constraint).validate("sampling")
    assert str(err.value).startswith(field)
    assert len(str(err.value)) < 1000           # status details travel in size-limited metadata


def test_a_request_validates_its_constraint():
    with pytest.raises(InvalidArgument, match="^sampling.constraint.value"):
        GenerationRequest(prompt="x", sampling=SamplingParams(constraint=Constraint("regex", "(")))
    with pytest.raises(InvalidArgument, match="^sampling.constraint must be a Constraint"):
        SamplingParams(constraint="json").validate("sampling")


def test_at_most_one_constraint():
    assert constraint_from() is None
    assert constraint_from(json_schema=SCHEMA) == Constraint("json_schema", json.dumps(SCHEMA))
    assert constraint_from(json_object=True) == Constraint("json_object")
    with pytest.raises(InvalidArgument, match="at most one constraint"):
        constraint_from(regex="a", grammar='start: "a"')


@pytest.mark.parametrize("constraint", GOOD + [None], ids=lambda c: getattr(c, "kind", "none"))
def test_the_wire_twin_round_trips(constraint):
    params = SamplingParams(temperature=0.5, constraint=constraint)
    assert wire.sampling_from_proto(wire.sampling_to_proto(params)) == params
    request = GenerationRequest(prompt="x", sampling=params)
    assert wire.generation_request_from_proto(wire.generation_request_to_proto(request)) == request


def test_the_wire_refuses_unknown_kinds_and_bad_values():
    msg = common_pb2.SamplingParams(constraint=common_pb2.Constraint(kind=99, value="x"))
    with pytest.raises(InvalidArgument, match="^sampling.constraint.kind 99"):
        wire.sampling_from_proto(msg)
    msg = common_pb2.SamplingParams(constraint=common_pb2.Constraint(kind=common_pb2.CONSTRAINT_KIND_REGEX, value="("))
    with pytest.raises(InvalidArgument, match="^sampling.constraint.value"):
        wire.sampling_from_proto(msg)
    unspecified = common_pb2.SamplingParams(constraint=common_pb2.Constraint())
    assert wire.sampling_from_proto(unspecified).constraint is None


@pytest.mark.parametrize("kw,want", [
    ({"json_schema": SCHEMA}, Constraint("json_schema", json.dumps(SCHEMA))),
    ({"json_schema": json.dumps(SCHEMA)}, Constraint("json_schema", json.dumps(SCHEMA))),
    ({"regex": "[ab]+"}, Constraint("regex", "[ab]+")), ({"grammar": 'start: "a"'}, Constraint("grammar", 'start: "a"')),
    ({"json_object": True}, Constraint("json_object")), ({}, None)])
def test_sdk_keywords_build_the_constraint(kw, want):
    msg = build_request("x", **kw)
    assert wire.sampling_from_proto(msg.sampling).constraint == want


def test_sdk_refuses_two_constraints():
    with pytest.raises(ValueError, match="at most one constraint"):
        build_request("x", regex="a", json_object=True)


def test_a_constraint_past_the_engines_limits_is_refused(tiny_family):
    """Valid, but too costly to follow: a mask hits llguidance's limit (bounded
    work) and the verifier refuses the session (INVALID_ARGUMENT), never
    generating unconstrained text."""
    from specdec.model.loading import ModelSpec, default_grammar_tokenizer
    from specdec.tree.build import tree_from_lists
    from verifier.engine import TargetModel, VerifierEngine

    engine = VerifierEngine(TargetModel(ModelSpec(str(tiny_family["target"]))),
                            grammar_tokenizer=default_grammar_tokenizer(None, tiny_family["target"]))
    with pytest.raises(InvalidArgument, match="^sampling.constraint is too costly"):
        first = engine.prefill("s", [1, 2, 3], SamplingParams(constraint=Constraint("regex", "a{1000000}"))).token
        for _ in range(4):
            first = engine.verify("s", tree_from_lists([first], [-1])).tokens[-1]
