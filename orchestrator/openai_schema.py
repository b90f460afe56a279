"""The OpenAI-compatible request and response bodies, and their mapping to specdec's own.

Requests are pydantic models that ignore unknown fields (as OpenAI-compatible
servers do); a field of the wrong type is a 400 naming it. One function,
``generation_request``, turns a request (and its rendered prompt) into the
validated ``specdec.request.params.GenerationRequest``: every parameter is mapped, or
refused, there. Values out of bounds are refused by ``specdec.request.params`` with
``InvalidArgument``; ``openai_param`` names the OpenAI parameter it is about.

Parameter mapping:
- ``max_tokens`` / ``max_completion_tokens`` -> max_new_tokens (unset: the
  server's default, ``--max-new-tokens``);
- ``temperature`` (unset: 1, as OpenAI), ``top_p``, ``top_k`` (vLLM's extra;
  -1 or 0 = off), ``seed`` -> SamplingParams;
- ``stop`` (a string or a list) -> stop strings;
- ``frequency_penalty``, ``presence_penalty``, ``repetition_penalty`` (vLLM's
  extra), ``min_p`` (vLLM's extra) -> SamplingParams (the verifier applies
  them per tree node: speculation stays lossless);
- ``logit_bias`` ({"token id": bias}, at most
  ``specdec.request.params.MAX_LOGIT_BIAS`` entries, each in [-100, 100]) ->
  SamplingParams.logit_bias (added to the logits before the penalties, at
  every tree node, greedy decoding included);
- ``method`` (specdec's extra): the request's tree method, as through gRPC
  (``specdec.request.params.REQUEST_METHODS``, e.g. "static" for a Medusa
  or Hydra drafter's mc_sim_7b_63 tree, "vanilla"; unset: the orchestrator's
  default);
- ``n``: n independent choices of one request; with a seed, choice i samples
  with ``specdec.request.params.choice_seed(seed, i)`` (choice 0 with the seed
  itself), as through gRPC, so every choice reproduces;
- chat ``logprobs`` (+ ``top_logprobs`` alternatives), completions
  ``logprobs`` (that many alternatives) -> logprobs: each token's raw-model
  logprob, in OpenAI's shapes (``chat_logprobs``, ``completion_logprobs``);
- completions ``echo``: the choice's text starts with the prompt; with
  ``logprobs`` -> prompt_logprobs too (the verifier's prefill scores the
  prompt), listed before the generated tokens' with null for the first prompt
  token, as OpenAI does; ``max_tokens`` 0 (refused without echo) -> a
  prompt-only request (``prompt_only``: nothing generated, n 1). Not with
  ``stream`` (400);
- ``response_format`` (json_object, json_schema), the extras ``guided_json``,
  ``guided_regex``, ``guided_grammar``, ``structured_outputs``, and ``tools``
  with a named ``tool_choice`` -> SamplingParams.constraint
  (``orchestrator.structured``: the grammar masks every tree node along its
  own path, so the output is exactly constrained decoding's); a named tool's
  answer is ``message.tool_calls`` with ``finish_reason`` "tool_calls";
- ``suffix``, ``best_of`` > 1, ``tool_choice`` "auto": refused (400) rather
  than ignored, since ignoring them would change what the client gets.

Responses carry each choice's speculation statistics (tau, acceptance per
position, the time split: ``GenerationStats``) in a ``specdec`` object of the
choice, and, with ``return_token_ids`` (vLLM's extra), its ``token_ids``.
"""

from __future__ import annotations

import re
import uuid
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdec.request.errors import InvalidArgument
from specdec.request.params import (MAX_LOGPROBS, GenerationRequest, SamplingParams, TokenLogprob, TreeRequest,
                                    shown)
from specdec.v1 import orchestrator_pb2
from orchestrator import structured

MAX_CHOICES = 16             # n
MAX_PROMPTS = 16             # prompts in one completions request
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
STATS_FIELDS = tuple(f.name for f in orchestrator_pb2.GenerationStats.DESCRIPTOR.fields)


# -- requests ----------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class CommonRequest(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = False
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    method: str | None = None         # specdec's extra: the tree method (TreeRequest.method)
    # structured output extras, as vLLM names them (``orchestrator.structured``)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    cache_salt: str = ""                      # vLLM's: prefix-cache isolation within the caller's tenant


class CompletionRequest(CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")      # name, tool_call_id, ... reach the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# -- requests -> GenerationRequest -------------------------------------------------------------
def unsupported(req: CommonRequest) -> None:
    """400 naming the first parameter this server cannot honour."""
    if not isinstance(req, ChatCompletionRequest):
        if req.echo and req.stream:
            raise InvalidArgument("echo is not supported with stream: true (ask without streaming)")
        if req.suffix:
            raise InvalidArgument("suffix is not supported")
        if req.best_of not in (None, 1, req.n):
            raise InvalidArgument(f"best_of must equal n (no best-of ranking), got {req.best_of}")


def logit_bias(req: CommonRequest) -> dict[int, float]:
    """``logit_bias`` with its keys (JSON strings) as token ids; the bounds are
    ``SamplingParams``' (and the verifier's vocabulary)."""
    out = {}
    for key, bias in (req.logit_bias or {}).items():
        if not re.fullmatch(r"-?\d{1,12}", key.strip()):
            raise InvalidArgument(f"logit_bias: the key {shown(key)} is not a token id (an integer)")
        if int(key) in out:
            raise InvalidArgument(f"logit_bias: token id {int(key)} is given twice")
        out[int(key)] = bias
    return out


def echoes(req: CommonRequest) -> bool:
    """A completions request whose choices start with their prompt."""
    return isinstance(req, CompletionRequest) and req.echo


def logprobs_asked(req: CommonRequest) -> int | None:
    """The alternatives per token the request asks logprobs with; None: no logprobs."""
    if isinstance(req, ChatCompletionRequest):
        if not req.logprobs:
            if req.top_logprobs:
                raise InvalidArgument("top_logprobs needs logprobs: true")
            return None
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}")
        return req.top_logprobs or 0
    return req.logprobs


def generation_request(req: CommonRequest, prompt: str, request_id: str = "") -> GenerationRequest:
    """The validated specdec request for one prompt of ``req`` (its ``n`` choices)."""
    unsupported(req)
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise InvalidArgument("max_completion_tokens and max_tokens disagree: give one of them")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    prompt_only = echoes(req) and max_tokens == 0       # score the prompt, generate nothing
    if max_tokens is not None and max_tokens < 1 and not prompt_only:
        raise InvalidArgument(f"{max_tokens_param(req)} must be >= 1, got {max_tokens}")
    if not 1 <= req.n <= MAX_CHOICES:
        raise InvalidArgument(f"n must be in [1, {MAX_CHOICES}], got {req.n}")
    if prompt_only and req.n != 1:
        raise InvalidArgument(f"n must be 1 with echo and {max_tokens_param(req)} 0 (the prompt alone), "
                              f"got {req.n}")
    top_k = 0 if req.top_k == -1 else req.top_k
    sampling = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature, top_k=top_k or 0,
        top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed,
        min_p=0.0 if req.min_p is None else req.min_p,
        presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
        frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=logit_bias(req), constraint=structured.request_constraint(req)[0])
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    logprobs = logprobs_asked(req)
    return GenerationRequest(prompt=prompt, max_new_tokens=max_tokens or 0, sampling=sampling, stop=stop,
                             tree=TreeRequest(method=req.method or ""),
                             request_id=request_id, n=req.n, logprobs=logprobs, prompt_only=prompt_only,
                             prompt_logprobs=logprobs if echoes(req) else None, cache_salt=req.cache_salt)


def called_tool(req: CommonRequest) -> str | None:
    """The function a chat request's named ``tool_choice`` calls (its answer is a tool call), else None."""
    return structured.request_constraint(req)[1] if isinstance(req, ChatCompletionRequest) else None


def completion_prompts(req: CompletionRequest) -> list[str]:
    prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    if not prompts:
        raise InvalidArgument("prompt must not be empty")
    if not all(isinstance(p, str) for p in prompts):
        raise InvalidArgument("prompt as token ids is not supported yet: send text")
    if len(prompts) > MAX_PROMPTS:
        raise InvalidArgument(f"prompt: at most {MAX_PROMPTS} prompts in one request, got {len(prompts)}")
    return prompts


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """The messages as the template sees them: content as one string."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            kinds = {p.type for p in content} - {"text"}
            if kinds:
                raise InvalidArgument(f"messages[{i}].content: only text parts are supported, got {sorted(kinds)}")
            content = "".join(p.text or "" for p in content)
        out.append({**(m.model_extra or {}), "role": m.role, "content": content or ""})
    return out


def max_tokens_param(req: CommonRequest) -> str:
    return "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"


# specdec field (as specdec.request.params writes it) -> the OpenAI parameter
FIELD_PARAMS = {"sampling.temperature": "temperature", "sampling.top_p": "top_p", "sampling.top_k": "top_k",
                "sampling.seed": "seed", "sampling.min_p": "min_p", "sampling.presence_penalty": "presence_penalty",
                "sampling.frequency_penalty": "frequency_penalty",
                "sampling.repetition_penalty": "repetition_penalty", "sampling.logit_bias": "logit_bias",
                "stop": "stop", "request_id": "x-request-id", "tree.method": "method"}
LEADING_FIELD = re.compile(r"^([A-Za-z_][\w.]*)(\[\d+\])?")


def openai_param(message: str, req: CommonRequest | None) -> tuple[str | None, str]:
    """(the OpenAI parameter an InvalidArgument message is about, the message in
    OpenAI's names): ``sampling.top_p must be ...`` -> ``top_p``."""
    m = LEADING_FIELD.match(message)
    if m is None:
        return None, message
    field = m.group(1)
    if field in FIELD_PARAMS:
        param = FIELD_PARAMS[field]
    elif field == "max_new_tokens":
        param = max_tokens_param(req) if req is not None else "max_tokens"
    elif field == "prompt":
        param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    elif field.split(".")[0] in (CommonRequest.model_fields.keys() | CompletionRequest.model_fields.keys()
                                 | ChatCompletionRequest.model_fields.keys()):
        param = field.split(".")[0]
    else:
        return None, message
    return param, param + message[len(field):]


# -- responses ----------------------------------------------------------------------------------
def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def finish_reason(stats: orchestrator_pb2.GenerationStats) -> str:
    return FINISH_REASONS.get(stats.finish_reason, "stop")


def stats_dict(stats: orchestrator_pb2.GenerationStats) -> dict:
    """The ``specdec`` extension object: every GenerationStats field."""
    return {name: (list(value) if name == "accepted_per_position" else value)
            for name in STATS_FIELDS for value in (getattr(stats, name),)}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_logprobs(entries: list[TokenLogprob], token_text: Callable[[int], str]) -> dict:
    """Chat's ``logprobs``: per token its text, logprob, UTF-8 bytes and the top alternatives."""
    def item(token: int, logprob: float) -> dict:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**item(e.token, e.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in zip(e.top_tokens, e.top_logprobs)]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: list[TokenLogprob], token_text: Callable[[int], str], offset: int = 0,
                        prompt: tuple[list[int], list[TokenLogprob]] | None = None) -> dict:
    """Completions' ``logprobs``: tokens, their logprobs, the top alternatives
    ({text: logprob}) and each token's offset in the choice's text (the first at
    ``offset``). ``prompt`` (echo): the prompt's token ids and the logprobs of
    all but the first, listed first; the first prompt token has null for its
    logprob and alternatives, as OpenAI answers."""
    ids, logprobs, tops = [], [], []
    if prompt is not None:
        prompt_ids, scored = prompt
        ids += prompt_ids
        logprobs += [None] + [e.logprob for e in scored]
        tops += [None] + [{token_text(t): lp for t, lp in zip(e.top_tokens, e.top_logprobs)} for e in scored]
    ids += [e.token for e in entries]
    logprobs += [e.logprob for e in entries]
    tops += [{token_text(t): lp for t, lp in zip(e.top_tokens, e.top_logprobs)} for e in entries]
    tokens = [token_text(t) for t in ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def choice_body(kind: str, index: int, text: str, result=None, token_ids: bool = False,
                stream: bool = False, logprobs: dict | None = None, tool: str | None = None) -> dict:
    """A choice of a response (``result`` set), or of a stream chunk: a delta
    of text, or the choice's last chunk (``result`` set, ``text`` "");
    ``logprobs``: its tokens' (``chat_logprobs``, ``completion_logprobs``);
    ``tool``: the function a named tool choice calls (the text is its arguments)."""
    done = result is not None
    if kind == "chat" and not stream:
        body = {"index": index, "message": {"role": "assistant", "content": text} if tool is None else
                structured.tool_call_message(tool, text, structured.new_call_id())}
    elif kind == "chat":
        body = {"index": index, "delta": ({"content": text} if tool is None else structured.tool_call_delta(text))
                if text else {}}
    else:
        body = {"index": index, "text": text}
    body["logprobs"] = logprobs
    body["finish_reason"] = finish_reason(result.stats) if done else None
    if tool is not None and body["finish_reason"] == "stop":
        body["finish_reason"] = "tool_calls"
    if done:
        if token_ids:
            body["token_ids"] = list(result.token_ids)
        body["specdec"] = stats_dict(result.stats)
    return body


def envelope(kind: str, rid: str, created: int, model: str, choices: list[dict], stream: bool) -> dict:
    obj = {"chat": ("chat.completion", "chat.completion.chunk"),
           "completion": ("text_completion", "text_completion")}[kind][stream]
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}


def role_delta(index: int, tool: str | None = None) -> dict:
    """A chat stream's first chunk of a choice: the role (and, for a named tool
    choice, the call's id and function name)."""
    delta = {"role": "assistant", "content": ""} if tool is None else \
        {"role": "assistant", "content": None, **structured.tool_call_delta("", tool, structured.new_call_id())}
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
