"""Structured output over the OpenAI API: request parameters -> one ``Constraint``, tool calls out.

Parameters (at most one of them constrains a request; two are a 400):

- ``response_format`` (chat): ``{"type": "text"}`` (none), ``{"type": "json_object"}``
  (any JSON object), ``{"type": "json_schema", "json_schema": {"name": ..., "schema":
  {...}, "strict": ...}}`` (JSON valid under ``schema``; ``strict`` is accepted and
  changes nothing: the output always follows the schema);
- extras, as vLLM names them, on both endpoints: ``guided_json`` (a schema, object
  or text), ``guided_regex``, ``guided_grammar`` (a Lark grammar, llguidance's
  dialect), ``structured_outputs`` (``{"json": ..., "regex": ..., "grammar": ...,
  "json_object": true}``, one key);
- ``tools`` with ``tool_choice`` (chat): a named function
  (``{"type": "function", "function": {"name": ...}}``) constrains the output to
  its ``parameters`` schema and the answer comes back as ``message.tool_calls``
  (one call, ``finish_reason`` "tool_calls"); ``"none"``: no constraint, the
  tools are ignored; ``"required"`` with a single tool: that tool. ``"auto"``
  (OpenAI's default when tools are given) and ``"required"`` over several tools
  are refused (400): choosing whether and which tool to call would need the
  model's own tool-call format, which differs per chat template.

The constraint's bounds are ``specdec.request.constraints``'; an error names
the parameter as the client wrote it (``response_format.json_schema.schema``).
"""

from __future__ import annotations

import uuid
from typing import Any

from specdec.request.constraints import Constraint, constraint_from
from specdec.request.errors import InvalidArgument
from specdec.request.params import shown

STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "grammar": "grammar", "json_object": "json_object"}


def _response_format(fmt: dict[str, Any] | None) -> tuple[Constraint | None, str]:
    if not fmt:
        return None, ""
    kind = fmt.get("type", "text")
    if kind == "text":
        return None, ""
    if kind == "json_object":
        return Constraint("json_object"), "response_format"
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, str)):
            raise InvalidArgument("response_format.json_schema.schema is required (a JSON Schema object)")
        return constraint_from(json_schema=spec["schema"]), "response_format.json_schema.schema"
    raise InvalidArgument(f"response_format.type must be text, json_object or json_schema, got {shown(kind)}")


def _extras(req) -> tuple[Constraint | None, str]:
    given = [(name, getattr(req, name, None)) for name in ("guided_json", "guided_regex", "guided_grammar")]
    given = [(n, v) for n, v in given if v is not None]
    structured = getattr(req, "structured_outputs", None)
    if structured:
        if not isinstance(structured, dict) or len(structured) != 1 or next(iter(structured)) not in STRUCTURED_KEYS:
            raise InvalidArgument(f"structured_outputs must have one key of {', '.join(STRUCTURED_KEYS)}, "
                                  f"got {shown(structured)}")
        key, value = next(iter(structured.items()))
        given.append((f"structured_outputs.{key}", (STRUCTURED_KEYS[key], value)))
    if len(given) > 1:
        raise InvalidArgument(f"give at most one of guided_json, guided_regex, guided_grammar, structured_outputs; "
                              f"got {' and '.join(n for n, _ in given)}")
    if not given:
        return None, ""
    name, value = given[0]
    kind = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar"}.get(name)
    if kind is None:
        kind, value = value
    if kind == "json_object":
        return (Constraint("json_object") if value else None), name
    if kind == "json_schema":
        if not isinstance(value, (dict, str)):
            raise InvalidArgument(f"{name} must be a JSON Schema (an object or its text), got {shown(value)}")
        return constraint_from(json_schema=value), name
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a string, got {shown(value)}")
    return Constraint(kind, value), name


def _tool(req) -> tuple[Constraint | None, str, str | None]:
    """(constraint, its parameter name, the called function's name) of ``tools`` + ``tool_choice``."""
    tools = getattr(req, "tools", None) or []
    choice = getattr(req, "tool_choice", None)
    if not tools:
        if choice not in (None, "none"):
            raise InvalidArgument("tool_choice needs tools")
        return None, "", None
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidArgument(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        names.append(fn["name"])
    if choice == "none":
        return None, "", None
    if choice is None or choice == "auto":
        raise InvalidArgument('tool_choice "auto" is not supported: name the function (tool_choice {"type": '
                              '"function", "function": {"name": ...}}), or give "none"')
    if choice == "required":
        if len(tools) != 1:
            raise InvalidArgument('tool_choice "required" is supported with a single tool only: name the function')
        name = names[0]
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict) and \
            isinstance(choice["function"].get("name"), str):
        name = choice["function"]["name"]
        if name not in names:
            raise InvalidArgument(f"tool_choice names the function {shown(name)}, which is not among the tools")
    else:
        raise InvalidArgument(f"tool_choice must be \"none\", \"required\" or {{\"type\": \"function\", "
                              f"\"function\": {{\"name\": ...}}}}, got {shown(choice)}")
    index = names.index(name)
    parameters = tools[index]["function"].get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(parameters, (dict, str)):
        raise InvalidArgument(f"tools[{index}].function.parameters must be a JSON Schema object")
    return constraint_from(json_schema=parameters), f"tools[{index}].function.parameters", name


def request_constraint(req) -> tuple[Constraint | None, str | None]:
    """The request's constraint (validated, errors naming the client's
    parameter) and the function a named tool choice calls (None: no tool call)."""
    found = [c for c in (_response_format(getattr(req, "response_format", None)), _extras(req)) if c[0] is not None]
    tool, tool_field, tool_name = _tool(req)
    if tool is not None:
        found.append((tool, tool_field))
    if len(found) > 1:
        raise InvalidArgument(f"give one structured output constraint, got {' and '.join(f for _, f in found)}")
    if not found:
        return None, None
    constraint, field = found[0]
    constraint.validate(field)
    return constraint, tool_name


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_message(name: str, arguments: str, call_id: str) -> dict:
    """A chat response's message calling ``name`` with the generated ``arguments`` (JSON text)."""
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}


def tool_call_delta(arguments: str, name: str | None = None, call_id: str | None = None) -> dict:
    """A chat stream's delta: the call's header (``name`` and ``call_id`` given)
    or a piece of its arguments."""
    call: dict = {"index": 0, "function": {"arguments": arguments}}
    if name is not None:
        call = {"index": 0, "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"tool_calls": [call]}
