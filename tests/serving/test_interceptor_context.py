"""The server interceptor around a streaming call closed from another context:
an abandoned response stream is closed by the event loop's async-generator
finalizer, in a task of its own (a fresh context), e.g. when ``specdec up``
stops its services after the demo; the interceptor then logged a "Task
exception was never retrieved" ValueError (a context variable's token reset
in a context that never set it)."""

from __future__ import annotations

import asyncio
import contextvars

import grpc
import pytest

pytestmark = pytest.mark.asyncio

from specdec.serving.interceptor import RpcInterceptor, wrap_handler
from specdec.serving.logs import request_id_var


class Context:
    def code(self):
        return None


async def test_a_stream_closed_from_a_fresh_context_ends_its_call_cleanly():
    in_flight = [0]
    interceptor = RpcInterceptor("verifier", None, in_flight)

    async def handler(request, context):
        for i in range(10):
            yield i

    wrapped = wrap_handler(grpc.unary_stream_rpc_method_handler(handler),
                           lambda context: interceptor._observe(context, "specdec.v1.Svc", "Stream", "r1"))
    stream = wrapped.unary_stream(None, Context())
    assert await stream.__anext__() == 0
    assert request_id_var.get() == "r1" and in_flight == [1]
    # closed as the loop's finalizer closes an abandoned generator: a task with a context of its own
    await asyncio.get_running_loop().create_task(stream.aclose(), context=contextvars.Context())
    assert in_flight == [0]


async def test_a_stream_closed_where_it_ran_resets_the_request_id():
    interceptor = RpcInterceptor("verifier", None, [0])

    async def handler(request, context):
        yield 1

    async def call():
        wrapped = wrap_handler(grpc.unary_stream_rpc_method_handler(handler),
                               lambda context: interceptor._observe(context, "specdec.v1.Svc", "Stream", "r2"))
        stream = wrapped.unary_stream(None, Context())
        assert [item async for item in stream] == [1]
        return request_id_var.get()

    assert await asyncio.create_task(call()) == ""
