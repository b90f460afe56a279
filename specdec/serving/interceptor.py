"""The interceptor every specdec server runs (``specdec.serving.server.start_server``),
and the mapping from errors to gRPC statuses.

Around each RPC but health checks: the bearer-token check, the request id
(``x-request-id`` metadata, or a fresh one when absent or not a valid id, into
``specdec.serving.logs.request_id_var``), RPC duration / count metrics, the in-flight
count, and errors. Servicers are thin translators: a handler (unary or
streaming) converts its proto (``specdec.request.wire``), calls the domain, returns or
writes protos, and just raises; here a ``SpecdecError`` becomes its status, a
ValueError INVALID_ARGUMENT, each with its message, and anything else is
logged once and answered INTERNAL. No torch here.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import NoReturn

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2

from specdec.request.errors import SpecdecError
from specdec.request.params import is_request_id
from specdec.serving import metrics
from specdec.serving.logs import request_id_var

log = logging.getLogger("specdec.serving.server")

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
_HEALTH_PREFIX = f"/{HEALTH_SERVICE}/"
_REFLECTION_PREFIX = "/grpc.reflection."


def token_ok(header: str | None, token: str) -> bool:
    scheme, _, value = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())


def wrap_handler(handler: grpc.RpcMethodHandler, around) -> grpc.RpcMethodHandler:
    """The same handler with each call run inside ``around(context)`` (an async
    context manager); handles both response styles (value / async generator)."""

    def unary_response(inner):
        async def behavior(request, context):
            async with around(context):
                result = inner(request, context)
                return await result if inspect.isawaitable(result) else result
        return behavior

    def stream_response(inner):
        if inspect.isasyncgenfunction(inner):
            async def behavior(request, context):
                async with around(context):
                    async for item in inner(request, context):
                        yield item
            return behavior
        return unary_response(inner)

    kinds = (("unary_unary", unary_response, grpc.unary_unary_rpc_method_handler),
             ("unary_stream", stream_response, grpc.unary_stream_rpc_method_handler),
             ("stream_unary", unary_response, grpc.stream_unary_rpc_method_handler),
             ("stream_stream", stream_response, grpc.stream_stream_rpc_method_handler))
    for attr, wrapper, make in kinds:
        inner = getattr(handler, attr)
        if inner is not None:
            return make(wrapper(inner), request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
    return handler


class RpcInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, role: str, token: str | None, in_flight: list[int]):
        self.role = role
        self.token = token
        self.in_flight = in_flight          # one-element list shared with RunningServer

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(_HEALTH_PREFIX):
            return handler
        md = {k: v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}
        if self.token is not None and not token_ok(md.get("authorization"), self.token):
            @asynccontextmanager
            async def deny(context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                    "missing or invalid bearer token (metadata 'authorization: Bearer <token>')")
                yield
            return wrap_handler(handler, deny)
        if method.startswith(_REFLECTION_PREFIX):
            return handler
        service, _, name = method.lstrip("/").rpartition("/")
        rid = md.get("x-request-id")
        if not is_request_id(rid):             # absent, or not one a request could carry: a fresh one
            rid = uuid.uuid4().hex[:16]
        return wrap_handler(handler, lambda context: self._observe(context, service, name, rid))

    @asynccontextmanager
    async def _observe(self, context, service: str, name: str, rid: str):
        token = request_id_var.set(rid)
        depth = metrics.QUEUE_DEPTH.labels(self.role)
        depth.inc()
        self.in_flight[0] += 1
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            yield
            code = context.code() or grpc.StatusCode.OK
        except grpc.aio.AbortError:
            code = context.code() or grpc.StatusCode.UNKNOWN
            raise
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            # the one place errors become statuses: handlers just raise
            code = status_code_of(exc)
            await abort_from(context, exc)
        finally:
            elapsed = time.perf_counter() - start
            self.in_flight[0] -= 1
            depth.dec()
            code_name = code.name if isinstance(code, grpc.StatusCode) else str(code)
            metrics.RPC_DURATION.labels(service, name).observe(elapsed)
            metrics.RPCS.labels(service, name, code_name).inc()
            log.log(logging.DEBUG if code_name == "OK" else logging.INFO, "rpc",
                    extra={"method": f"{service}/{name}", "code": code_name, "ms": round(elapsed * 1e3, 3)})
            try:
                request_id_var.reset(token)
            except ValueError:
                # a stream closed from elsewhere (an abandoned response generator is closed by the
                # loop's finalizer, in a context of its own, at shutdown): it was never set there
                pass


# -- errors as statuses ----------------------------------------------------------------------------------
def status_code_of(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code()
    if isinstance(exc, SpecdecError):
        return getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INTERNAL)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.INTERNAL


async def abort_from(context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
    """End the RPC with the status ``exc`` stands for; unexpected errors are logged."""
    code = status_code_of(exc)
    if isinstance(exc, grpc.aio.AioRpcError):
        message = exc.details() or code.name
    elif code == grpc.StatusCode.INTERNAL:
        log.error("internal error", exc_info=exc)
        message = f"internal error: {type(exc).__name__}: {exc}"
    else:
        message = str(exc) or type(exc).__name__
    await context.abort(code, message)
