"""Structured-output constraints, torch-free: what a client may constrain, its bounds, its compile check.

A ``Constraint`` restricts the tokens a session may generate to those a grammar
allows. It is part of the target's processed distribution (``specdec.tree.grammar``
turns it into a per-node token mask), so speculative decoding under a
constraint is exactly constrained decoding.

Kinds (``CONSTRAINT_KINDS``), with what ``value`` holds:

- ``json_object``: any JSON object (OpenAI's ``response_format`` json_object); value "";
- ``json_schema``: a JSON value valid under the JSON Schema text in value (OpenAI's
  ``json_schema``; a tool's ``parameters``);
- ``regex``: the whole output matches the regular expression in value;
- ``grammar``: the output is a sentence of the Lark grammar in value (llguidance's
  dialect: ``start: ...`` rules, ``%json {...}`` schemas inline).

The grammar engine is llguidance (Rust; pip ``llguidance``, no dependencies): it
computes a token mask in tens of microseconds on a CPU, rolls a matcher back by
any number of tokens (what walking a draft tree needs), and needs no torch, so
the torch-free orchestrator checks and compiles a constraint before any model
sees it. vLLM and llama.cpp use it too.

Bounds: ``value`` at most ``MAX_CONSTRAINT_CHARS`` characters and, for schemas,
JSON nested at most ``MAX_SCHEMA_DEPTH`` deep; the compile runs under
``PARSER_LIMITS`` (llguidance's bounds on grammar size, lexer states and the
work per token), so a huge, deeply nested, recursive or unsatisfiable
constraint is an ``InvalidArgument`` or a bounded compile, never a hung worker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

import llguidance

from specdec.request.checks import check_choice, check_text, shown
from specdec.request.errors import InvalidArgument

CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "grammar")
MAX_CONSTRAINT_CHARS = 64 * 1024     # a schema or grammar's text (OpenAI's schemas are far smaller)
MAX_SCHEMA_DEPTH = 32                # nesting of a schema's JSON (objects and arrays)
MAX_ERROR_CHARS = 300                # of llguidance's compile error quoted back to the client
# JSON is generated in one layout, json.dumps's: ``{"a": 1, "b": [true, null]}``.
# Flexible whitespace would let a model spend its tokens on blanks (and loop on
# them); a schema's own "x-guidance" options may still ask for it.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's bounds for every constraint: grammar size, lexer states, fuel
    (work) at the first token and per token, Earley items per step. Each
    bounds a compile or a mask computation to milliseconds-to-seconds."""
    return llguidance.LLParserLimits(max_grammar_size=200_000, max_lexer_states=100_000,
                                     initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                                     step_max_items=50_000, max_items_in_row=2_000)


def _depth(value, limit: int) -> int:
    """The nesting depth of a parsed JSON value, counting no further than ``limit + 1``."""
    depth, level = 0, [value]
    while level and depth <= limit:
        depth += 1
        nxt = []
        for v in level:
            if isinstance(v, dict):
                nxt.extend(v.values())
            elif isinstance(v, list):
                nxt.extend(v)
        level = [v for v in nxt if isinstance(v, (dict, list))]
    return depth


def parse_schema(text: str, field: str) -> dict:
    """A JSON Schema's text as the object it must be (InvalidArgument naming ``field`` else)."""
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise InvalidArgument(f"{field}: at most {MAX_CONSTRAINT_CHARS} characters, got {len(text)}")
    try:
        schema = json.loads(text)
    except RecursionError:
        raise InvalidArgument(f"{field} is nested deeper than {MAX_SCHEMA_DEPTH} levels") from None
    except ValueError as exc:
        raise InvalidArgument(f"{field} is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise InvalidArgument(f"{field} must be a JSON object (a JSON Schema), got {shown(schema)}")
    if _depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise InvalidArgument(f"{field} is nested deeper than {MAX_SCHEMA_DEPTH} levels")
    return schema


@dataclass(frozen=True)
class Constraint:
    kind: str            # one of CONSTRAINT_KINDS
    value: str = ""      # schema JSON text, regex or Lark grammar; "" for json_object

    def validate(self, field: str = "constraint") -> Constraint:
        """Raise InvalidArgument naming ``field`` unless the constraint compiles within the limits."""
        try:
            check_constraint(self, field)
        except TypeError:                   # unhashable fields: not strings
            raise InvalidArgument(f"{field} must have a string kind and value") from None
        return self

    def grammar(self) -> str:
        """llguidance's grammar for it (valid once ``validate`` passed)."""
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.value, defaults=JSON_LAYOUT)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        return llguidance.LLMatcher.grammar_from_lark(self.value)


@lru_cache(maxsize=256)
def check_constraint(constraint: Constraint, field: str = "constraint") -> Constraint:
    """The constraint's kind and value in bounds and its grammar compiled under
    ``parser_limits`` (cached per value: the services check every request)."""
    if not isinstance(constraint, Constraint):
        raise InvalidArgument(f"{field} must be a Constraint, got {type(constraint).__name__}")
    check_choice(constraint.kind, CONSTRAINT_KINDS, f"{field}.kind")
    value_field = f"{field}.value"
    if constraint.kind == "json_object":
        if constraint.value:
            raise InvalidArgument(f"{value_field} must be empty for json_object, got {shown(constraint.value)}")
    else:
        check_text(constraint.value, value_field, MAX_CONSTRAINT_CHARS)
    if constraint.kind == "json_schema":
        parse_schema(constraint.value, value_field)
    try:
        grammar = constraint.grammar()
    except (ValueError, RecursionError) as exc:
        raise InvalidArgument(f"{value_field} does not compile: {str(exc)[:MAX_ERROR_CHARS]}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, None, limits=parser_limits())
    if error:
        raise InvalidArgument(f"{value_field} does not compile: {error[:MAX_ERROR_CHARS]}")
    return constraint


def constraint_from(json_schema=None, regex: str | None = None, grammar: str | None = None,
                    json_object: bool = False, field: str = "") -> Constraint | None:
    """The one constraint a client gave among these (a schema as text or as a
    parsed object), None for none; InvalidArgument when several are given."""
    given = [name for name, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar),
                                  ("json_object", json_object or None)) if v is not None]
    if len(given) > 1:
        where = f" ({field})" if field else ""
        raise InvalidArgument(f"give at most one constraint{where}, got {' and '.join(given)}")
    if not given:
        return None
    if json_object:
        return Constraint("json_object")
    if json_schema is not None:
        return Constraint("json_schema", json_schema if isinstance(json_schema, str) else json.dumps(json_schema))
    return Constraint("regex", regex) if regex is not None else Constraint("grammar", grammar)
