"""The OpenAI-compatible HTTP API of the orchestrator (FastAPI; served by ``orchestrator.http_server``).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /health`` (200 once the
backends answer, 503 while waiting for them or draining: the readiness probe)
and ``GET /health/live`` (200 while the process serves: the liveness probe).

Every generation runs in this process, on the same path as the gRPC
handlers (``OrchestratorService.generate``): no extra hop. A request becomes
one ``GenerationRequest`` per prompt (``orchestrator.openai_schema``), its
``n`` choices run by the service, the prompts concurrently; the client's disconnect (noticed while waiting, streaming
or not) cancels them all, which releases every session on both backends.

With ``echo`` (completions) each choice's text starts with its prompt and,
with ``logprobs``, its logprobs with the prompt's tokens' (the verifier's
prefill scores them); ``max_tokens`` 0 then scores the prompt alone.

Streaming (``stream: true``) answers with server-sent events, each
``data: <compact JSON>\\n\\n``: for chat, one chunk per choice with the role,
then text deltas, then each choice's last chunk (``finish_reason``, the
``specdec`` statistics), then, with ``stream_options.include_usage``, a chunk
with ``usage`` and no choices, and finally ``data: [DONE]\\n\\n``. Headers go
out with the first text, so a request refused before it (bad parameter,
capacity) still gets its HTTP status; an error after it is sent as an event
``data: {"error": {...}}`` before ``[DONE]``.

Errors are OpenAI's JSON, ``{"error": {"message", "type", "param", "code"}}``,
with the status the failure stands for: 400 (a bad parameter, named), 401
(no or a wrong bearer token, when the server has one), 404 (unknown model),
429 (every verifier at capacity), 503 (not ready or draining), 504 (past the
server's request timeout).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specdec.request.errors import InvalidArgument, SpecdecError, Unavailable
from specdec.request.params import is_request_id
from specdec.serving.logs import request_id_var
from specdec.serving.server import status_code_of
from orchestrator import openai_schema as schema
from orchestrator.chat_template import ChatTemplate, chat_prompt
from orchestrator.service import GenerationResult, OrchestratorService

TIMEOUT_GRACE_S = 0.1    # the service's own deadline fires first; this cap only catches a stuck call
CLIENT_CLOSED = 499      # nginx's status for a client that left (nobody reads it)

# gRPC status name -> (HTTP status, OpenAI error type, code)
ERRORS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error", None),
    "FAILED_PRECONDITION": (400, "invalid_request_error", None),
    "OUT_OF_RANGE": (400, "invalid_request_error", None),
    "UNAUTHENTICATED": (401, "invalid_request_error", "invalid_api_key"),
    "NOT_FOUND": (404, "invalid_request_error", "not_found"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error", "rate_limit_exceeded"),
    "UNAVAILABLE": (503, "server_error", "unavailable"),
    "DEADLINE_EXCEEDED": (504, "server_error", "timeout"),
}
INTERNAL = (500, "server_error", "internal_error")


@dataclass(frozen=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 0                              # 0 = any free port
    served_model_name: str | None = None       # None: the verifier's model name
    chat_template: ChatTemplate | None = None  # None: chat completions answer 400
    auth_token: str | None = None              # bearer token on /v1/* (not on /health)
    timeout_s: float | None = None             # per request (None: none); past it, 504
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"http port must be in [0, 65535], got {self.port}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"http request timeout must be > 0, got {self.timeout_s}")


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def api_error(exc: BaseException, req: schema.CommonRequest | None = None) -> ApiError:
    """The OpenAI error for a failure of the service (its status code decides)."""
    if isinstance(exc, ApiError):
        return exc
    timed_out = isinstance(exc, (TimeoutError, asyncio.TimeoutError))
    code = "DEADLINE_EXCEEDED" if timed_out else status_code_of(exc).name
    status, kind, err_code = ERRORS.get(code, INTERNAL)
    message = str(exc) or type(exc).__name__
    param = None
    if status == 400:
        param, message = schema.openai_param(message, req)
    return ApiError(status, message, kind, param, err_code)


class ClientGone(Exception):
    """The client disconnected before the answer was complete."""


@dataclass
class Event:
    index: int                              # the choice
    text: str = ""
    result: GenerationResult | None = None  # set on the choice's last event
    error: BaseException | None = None
    logprobs: list = field(default_factory=list)   # the text's tokens' (``specdec.request.params.TokenLogprob``)


class Run:
    """The generations of one HTTP request, one task per prompt (running its
    ``n`` choices), feeding one queue; choice ``n * prompt + i`` is choice i of
    that prompt. A disconnect of the client ends ``next`` with ClientGone."""

    GONE = Event(-1)

    def __init__(self, service: OrchestratorService, requests: list, timeout_s: float | None, receive,
                 stream: bool, tenant: str = ""):
        self.service = service
        self.tenant = tenant                    # the caller's bearer token (``OrchestratorService.generate``)
        self.timeout_s = timeout_s
        self.stream = stream                    # False: only each choice's end is an event
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.choices = sum(r.n for r in requests)
        self.left = self.choices
        starts = [sum(r.n for r in requests[:i]) for i in range(len(requests))]
        self.tasks = [asyncio.create_task(self._one(start, r)) for start, r in zip(starts, requests)]
        self.watcher = asyncio.create_task(self._watch(receive))

    async def _one(self, first: int, request) -> None:
        async def emit(index: int, delta, logprobs: list) -> None:
            if (delta.text or logprobs) and self.stream:
                self.queue.put_nowait(Event(first + index, delta.text, logprobs=logprobs))

        cap = None if self.timeout_s is None else self.timeout_s + TIMEOUT_GRACE_S
        try:
            results = await asyncio.wait_for(self.service.generate(request, emit, self.timeout_s, self.tenant), cap)
        except Exception as exc:
            self.queue.put_nowait(Event(first, error=exc))
        else:
            for i, result in enumerate(results):
                self.queue.put_nowait(Event(first + i, result=result))

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.queue.put_nowait(self.GONE)

    async def next(self) -> Event:
        """The next event of any choice; raises the first choice's error, or ClientGone."""
        event = await self.queue.get()
        if event is self.GONE:
            raise ClientGone()
        if event.error is not None:
            raise event.error
        if event.result is not None:
            self.left -= 1
        return event

    async def results(self) -> list[GenerationResult]:
        out: dict[int, GenerationResult] = {}
        while self.left:
            event = await self.next()
            if event.result is not None:
                out[event.index] = event.result
        return [out[i] for i in sorted(out)]

    async def close(self) -> None:
        """Cancel what still runs (releasing its sessions) and wait for it."""
        for task in (*self.tasks, self.watcher):
            task.cancel()
        await asyncio.gather(*self.tasks, self.watcher, return_exceptions=True)


def sse(obj) -> bytes:
    text = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {text}\n\n".encode()


def bearer(request: Request) -> str:
    """The bearer token an HTTP caller presented ("" for none): its tenant."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


class OpenAIApi:
    def __init__(self, service: OrchestratorService, config: HttpConfig):
        self.service = service
        self.config = config
        self.created = int(time.time())

    # -- checks ------------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        token = self.config.auth_token
        if token is None:
            return
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets_equal(value.strip(), token):
            raise ApiError(401, "missing or invalid bearer token (header 'Authorization: Bearer <token>')",
                           "invalid_request_error", None, "invalid_api_key")

    def model_name(self) -> str:
        if self.config.served_model_name:
            return self.config.served_model_name
        if self.service.verifier_info is None:
            raise api_error(Unavailable("not ready: waiting for a verifier"))
        return self.service.verifier_info.model

    def check_model(self, model: str | None) -> str:
        served = self.model_name()
        if model is not None and model != served:
            raise ApiError(404, f"The model `{model}` does not exist (this server serves `{served}`)",
                           "invalid_request_error", "model", "model_not_found")
        return served

    def ready(self) -> bool:
        lc = self.service.lifecycle
        return lc.ready and not lc.draining and self.service.verifier_info is not None

    # -- prompts -----------------------------------------------------------------------------
    def chat_prompt(self, req: schema.ChatCompletionRequest) -> str:
        template = self.config.chat_template
        if template is None:
            raise InvalidArgument("messages: this model has no chat template (start the server with "
                                  "--chat-template FILE)")
        return chat_prompt(template, schema.chat_messages(req), self.service.tokenizer, req.chat_template_kwargs)

    # -- the two generation endpoints --------------------------------------------------------
    async def answer(self, kind: str, req: schema.CommonRequest, request: Request) -> Response:
        rid = request.headers.get("x-request-id", "")
        rid = rid if is_request_id(rid) else uuid.uuid4().hex[:16]
        request_id_var.set(rid)
        try:
            model = self.check_model(req.model)
            prompts = [self.chat_prompt(req)] if kind == "chat" else schema.completion_prompts(req)
            requests = [schema.generation_request(req, p, rid) for p in prompts]
            tool = schema.called_tool(req)
        except SpecdecError as exc:
            return api_error(exc, req).response()
        run = Run(self.service, requests, self.config.timeout_s, request.receive, req.stream, bearer(request))
        meta = (kind, schema.new_id(kind), int(time.time()), model)
        try:
            if req.stream:
                first = await run.next()
                return StreamingResponse(self.stream(run, first, req, meta, tool),
                                         media_type="text/event-stream",
                                         headers={"cache-control": "no-cache", "x-request-id": rid})
            results = await run.results()
        except ClientGone:
            await run.close()
            return Response(status_code=CLIENT_CLOSED)
        except BaseException as exc:
            await run.close()
            if isinstance(exc, Exception):
                return api_error(exc, req).response()
            raise
        await run.close()
        echo = schema.echoes(req)
        texts = [(prompts[i // req.n] if echo else "") + r.text for i, r in enumerate(results)]
        body = schema.envelope(kind, meta[1], meta[2], model, [
            schema.choice_body(kind, i, text, r, req.return_token_ids,
                               logprobs=self.logprobs(kind, req, r.logprobs, prompt_of=r if echo else None),
                               tool=tool)
            for i, (text, r) in enumerate(zip(texts, results))], False)
        body["usage"] = self.usage(results, req.n)
        return JSONResponse(body, headers={"x-request-id": rid})

    def logprobs(self, kind: str, req: schema.CommonRequest, entries: list, offset: int = 0,
                 prompt_of: GenerationResult | None = None) -> dict | None:
        """A choice's (or chunk's) ``logprobs`` in the endpoint's shape; None when
        not asked for. ``prompt_of`` (echo): the result whose prompt's logprobs come first."""
        if schema.logprobs_asked(req) is None:
            return None
        token_text = self.token_text
        if kind == "chat":
            return schema.chat_logprobs(entries, token_text)
        prompt = None if prompt_of is None else (prompt_of.prompt_ids, prompt_of.prompt_logprobs)
        return schema.completion_logprobs(entries, token_text, offset, prompt)

    def token_text(self, token: int) -> str:
        return self.service.tokenizer.decode([token])

    @staticmethod
    def usage(results: list[GenerationResult], n: int) -> dict:
        """Each prompt counted once, whatever n."""
        prompt = sum(r.stats.prompt_tokens for r in results[::n])
        return schema.usage(prompt, sum(r.stats.completion_tokens for r in results))

    async def stream(self, run: Run, first: Event, req: schema.CommonRequest, meta: tuple,
                     tool: str | None = None) -> AsyncIterator[bytes]:
        kind, rid, created, model = meta
        include_usage = req.stream_options is not None and req.stream_options.include_usage

        def chunk(choices: list[dict]) -> bytes:
            body = schema.envelope(kind, rid, created, model, choices, True)
            if include_usage:
                body["usage"] = None
            return sse(body)

        results: dict[int, GenerationResult] = {}
        offsets = [0] * run.choices             # characters of each choice's text sent so far
        try:
            if kind == "chat":
                for index in range(run.choices):
                    yield chunk([schema.role_delta(index, tool)])
            event = first
            while True:
                if event.result is not None:
                    results[event.index] = event.result
                logprobs = (self.logprobs(kind, req, event.logprobs, offsets[event.index])
                            if event.result is None else None)
                offsets[event.index] += len(event.text)
                yield chunk([schema.choice_body(kind, event.index, event.text, event.result,
                                                req.return_token_ids, stream=True, logprobs=logprobs, tool=tool)])
                if not run.left:
                    break
                event = await run.next()
            if include_usage:
                ordered = [results[i] for i in sorted(results)]
                yield sse({**schema.envelope(kind, rid, created, model, [], True),
                           "usage": self.usage(ordered, req.n)})
        except ClientGone:
            return
        except Exception as exc:
            yield sse(api_error(exc, req).body())
        finally:
            await run.close()
        yield sse("[DONE]")


def secrets_equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body that does not parse, or a field of the wrong type: 400 naming it."""
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc and not loc[0].isdigit() else None
    where = ".".join(loc)
    message = f"{where}: {first.get('msg', 'invalid')}" if where else first.get("msg", "invalid request body")
    return ApiError(400, message, "invalid_request_error", param).response()


def build_app(service: OrchestratorService, config: HttpConfig) -> FastAPI:
    api = OpenAIApi(service, config)
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(ApiError, lambda request, exc: exc.response())
    auth = [Depends(api.authorize)]

    @app.post("/v1/completions", dependencies=auth)
    async def completions(req: schema.CompletionRequest, request: Request) -> Response:
        return await api.answer("completion", req, request)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(req: schema.ChatCompletionRequest, request: Request) -> Response:
        return await api.answer("chat", req, request)

    def model_card() -> dict:
        return {"id": api.model_name(), "object": "model", "created": api.created, "owned_by": "specdec"}

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", dependencies=auth)
    async def model(model: str) -> dict:
        api.check_model(model)
        return model_card()

    @app.get("/health")
    async def health() -> Response:
        if api.ready():
            return JSONResponse({"status": "ok"})
        draining = service.lifecycle.draining
        return api_error(Unavailable("draining" if draining else "not ready: waiting for the backends")).response()

    @app.get("/health/live")
    async def live() -> dict:
        return {"status": "ok"}

    return app

