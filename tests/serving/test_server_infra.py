"""Common server infrastructure on real servers: health transitions, drain,
reflection, metrics, bearer token, TLS / mutual TLS, request ids in JSON logs,
status mapping, and the ``serve`` CLI as a real process."""

import asyncio
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from serving.helpers import channel_to, load_verifier, rpc_error, start_verifier, verifier_builder
from specdec.request import errors
from specdec.serving.logs import JsonFormatter, request_id_var
from specdec.serving.server import ClientTls, ServerConfig, open_channel, start_server, status_code_of
from specdec.v1.common_pb2 import DraftTree
from specdec.v1.verifier_pb2 import (VerifierGetInfoRequest, VerifierPrefillRequest, VerifierReleaseRequest,
                                     VerifierSessionRequest, VerifyRequest)
from specdec.v1.verifier_pb2_grpc import VerifierServiceStub

CODE = grpc.StatusCode
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PROMPT = [5, 17, 42, 8]


async def health(ch, service: str, **kw) -> int:
    return (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), **kw)).status


# -- plain functions -------------------------------------------------------------------------------------
def test_status_codes_of_errors():
    assert status_code_of(errors.InvalidArgument("x")) == CODE.INVALID_ARGUMENT
    assert status_code_of(errors.NotFound("x")) == CODE.NOT_FOUND
    assert status_code_of(errors.ResourceExhausted("x")) == CODE.RESOURCE_EXHAUSTED
    assert status_code_of(errors.Unavailable("x")) == CODE.UNAVAILABLE
    assert status_code_of(errors.FailedPrecondition("x")) == CODE.FAILED_PRECONDITION
    assert status_code_of(ValueError("x")) == CODE.INVALID_ARGUMENT
    assert status_code_of(TimeoutError()) == CODE.DEADLINE_EXCEEDED
    assert status_code_of(RuntimeError("x")) == CODE.INTERNAL


@pytest.mark.parametrize("kw, words", [
    (dict(port=70000), "port must be in"), (dict(metrics_port=-1), "metrics-port"),
    (dict(tls_cert="c.pem"), "both a certificate and a key"), (dict(tls_client_ca="ca.pem"), "mutual TLS"),
    (dict(auth_token=" "), "auth token"), (dict(drain_s=-1.0), "drain"),
])
def test_server_config_rejects_bad_values(kw, words):
    with pytest.raises(ValueError, match=words):
        ServerConfig(**kw)


@pytest.mark.asyncio
async def test_a_taken_port_is_an_error_not_shared():
    first = await start_server(ServerConfig(metrics_port=None), [], "first")
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{first.port}"):
            await start_server(ServerConfig(port=first.port, metrics_port=None), [], "second")
    finally:
        await first.stop()


# -- health and drain ---------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_health_loading_ready_draining(tiny_family):
    server, servicer = await start_verifier(tiny_family, warm=False, metrics_port=None)
    async with channel_to(server) as ch:
        stub = VerifierServiceStub(ch)
        assert await health(ch, "liveness") == SERVING
        for service in ("readiness", "", "specdec.v1.VerifierService"):
            assert await health(ch, service) == NOT_SERVING
        err = await rpc_error(stub.Prefill(VerifierPrefillRequest(session_id="a", prompt_ids=PROMPT)))
        assert err.code() == CODE.UNAVAILABLE and "loading" in err.details()

        # the event loop keeps answering health checks while the model loads on the worker thread
        build = verifier_builder(tiny_family)
        loading = asyncio.create_task(servicer.load(lambda: (time.sleep(4.0), build())[1]))
        await asyncio.sleep(0.1)
        t = time.perf_counter()
        assert await health(ch, "readiness", timeout=3.0) == NOT_SERVING and not loading.done()
        assert time.perf_counter() - t < 3.0          # answered while the 4 s load still runs
        await loading
        server.set_ready(True)
        for service in ("readiness", "", "specdec.v1.VerifierService", "liveness"):
            assert await health(ch, service) == SERVING
        first = (await stub.Prefill(VerifierPrefillRequest(session_id="a", prompt_ids=PROMPT))).token

        # drain: not ready, no new sessions, open ones finish, then the server stops
        stopping = asyncio.create_task(server.stop(grace=10.0))
        await asyncio.sleep(0.1)
        assert await health(ch, "readiness") == NOT_SERVING and await health(ch, "liveness") == SERVING
        err = await rpc_error(stub.Prefill(VerifierPrefillRequest(session_id="b", prompt_ids=PROMPT)))
        assert err.code() == CODE.UNAVAILABLE and "draining" in err.details()
        await stub.Verify(VerifyRequest(session_id="a", tree=DraftTree(tokens=[first], parents=[-1])))
        assert not stopping.done()
        await stub.Release(VerifierReleaseRequest(session_id="a"))
        await asyncio.wait_for(stopping, 8.0)                  # no open session left: stops before the 10 s grace
        err = await rpc_error(stub.GetInfo(VerifierGetInfoRequest(), timeout=1.0))
        assert err.code() == CODE.UNAVAILABLE


@pytest.mark.asyncio
async def test_drain_gives_up_after_grace(verifier):
    server, _ = verifier
    async with channel_to(server) as ch:
        await VerifierServiceStub(ch).Prefill(VerifierPrefillRequest(session_id="left-open", prompt_ids=PROMPT))
    t = time.perf_counter()
    await server.stop(grace=0.3)
    assert 0.25 < time.perf_counter() - t < 8.0       # waited for the grace, then gave up


@pytest.mark.asyncio
async def test_health_watch_streams_readiness(tiny_family):
    server, servicer = await start_verifier(tiny_family, warm=False, metrics_port=None)
    try:
        async with channel_to(server) as ch:
            call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service="readiness"))
            seen = [(await call.read()).status]
            await load_verifier(server, servicer, tiny_family)
            seen.append((await asyncio.wait_for(call.read(), 5)).status)
            call.cancel()
        assert seen == [NOT_SERVING, SERVING]
    finally:
        await server.stop()


@pytest.mark.asyncio
async def test_reflection_lists_services(verifier_channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(verifier_channel)
    call = stub.ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    response = await call.read()
    await call.done_writing()
    names = {s.name for s in response.list_services_response.service}
    assert {"specdec.v1.VerifierService", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= names


# -- metrics -------------------------------------------------------------------------------------------------
def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.asyncio
async def test_metrics_endpoint_serves_and_counts(verifier, verifier_channel):
    server, _ = verifier
    stub = VerifierServiceStub(verifier_channel)
    verify_ok = ("specdec_rpcs_total", frozenset({("service", "specdec.v1.VerifierService"),
                                                  ("method", "Verify"), ("code", "OK")}))
    not_found = ("specdec_rpcs_total", frozenset({("service", "specdec.v1.VerifierService"),
                                                  ("method", "Verify"), ("code", "NOT_FOUND")}))
    kv = ("specdec_kv_cache_bytes", frozenset({("role", "verifier")}))
    active = ("specdec_active_sessions", frozenset({("role", "verifier")}))
    before = await asyncio.to_thread(scrape, server.metrics_port)
    for name in ("specdec_verify_duration_seconds_count", "specdec_draft_tokens_total", "specdec_drafts_total",
                 "specdec_accepted_tokens_total", "specdec_ttft_seconds_count",
                 "specdec_inter_token_latency_seconds_count", "specdec_request_duration_seconds_count"):
        assert any(key[0] == name for key in before), name
    assert before[active] == 0 and before[kv] == 0

    first = (await stub.Prefill(VerifierPrefillRequest(session_id="m", prompt_ids=PROMPT))).token
    await stub.Verify(VerifyRequest(session_id="m", tree=DraftTree(tokens=[first, 1, 2], parents=[-1, 0, 1])))
    await rpc_error(stub.Verify(VerifyRequest(session_id="gone", tree=DraftTree(tokens=[1], parents=[-1]))))
    after = await asyncio.to_thread(scrape, server.metrics_port)
    assert after[active] == 1 and after[kv] > 0
    assert after[verify_ok] == before.get(verify_ok, 0) + 1
    assert after[not_found] == before.get(not_found, 0) + 1
    count = ("specdec_verify_duration_seconds_count", frozenset())
    assert after[count] == before[count] + 1
    assert after[("specdec_queue_depth", frozenset({("role", "verifier")}))] == 0
    rpc_count = ("specdec_rpc_duration_seconds_count", frozenset({("service", "specdec.v1.VerifierService"),
                                                                  ("method", "Prefill")}))
    assert after[rpc_count] >= 1


# -- bearer token ------------------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_bearer_token(tiny_family):
    server, _ = await start_verifier(tiny_family, auth_token="s3cret", metrics_port=None)
    try:
        async with channel_to(server) as ch:
            stub = VerifierServiceStub(ch)
            for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "s3cret"),)):
                err = await rpc_error(stub.GetInfo(VerifierGetInfoRequest(), metadata=metadata))
                assert err.code() == CODE.UNAUTHENTICATED, metadata
            assert await health(ch, "readiness") == SERVING            # probes need no token
            await stub.GetInfo(VerifierGetInfoRequest(), metadata=(("authorization", "Bearer s3cret"),))
        async with channel_to(server, token="s3cret") as ch:
            assert (await VerifierServiceStub(ch).GetInfo(VerifierGetInfoRequest())).vocab_size > 0
            # a channel's token goes on its streams too (a session stream, written message by message)
            stream = VerifierServiceStub(ch).Session()
            await stream.write(VerifierSessionRequest(prefill=VerifierPrefillRequest(
                session_id="token-stream", prompt_ids=[1, 2, 3])))
            answer = await stream.read()
            assert answer != grpc.aio.EOF and answer.WhichOneof("step") == "prefill", await stream.details()
            await stream.done_writing()
            assert await stream.code() == CODE.OK
    finally:
        await server.stop()


# -- TLS ---------------------------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_tls_and_mutual_tls(tiny_family, certs):
    server_tls = dict(tls_cert=certs["server.pem"], tls_key=certs["server.key"], metrics_port=None)
    server, _ = await start_verifier(tiny_family, **server_tls)
    try:
        async with channel_to(server, tls=ClientTls(ca=certs["ca.pem"])) as ch:
            assert (await VerifierServiceStub(ch).GetInfo(VerifierGetInfoRequest())).vocab_size > 0
        async with channel_to(server) as ch:                                       # plaintext: refused
            err = await rpc_error(VerifierServiceStub(ch).GetInfo(VerifierGetInfoRequest(), timeout=3))
            assert err.code() == CODE.UNAVAILABLE
    finally:
        await server.stop()

    server, _ = await start_verifier(tiny_family, tls_client_ca=certs["ca.pem"], **server_tls)
    try:
        async with channel_to(server, tls=ClientTls(ca=certs["ca.pem"])) as ch:     # no client certificate
            err = await rpc_error(VerifierServiceStub(ch).GetInfo(VerifierGetInfoRequest(), timeout=3))
            assert err.code() == CODE.UNAVAILABLE
        mtls = ClientTls(ca=certs["ca.pem"], cert=certs["client.pem"], key=certs["client.key"], server_name="localhost")
        async with open_channel(f"localhost:{server.port}", tls=mtls) as ch:
            assert (await VerifierServiceStub(ch).GetInfo(VerifierGetInfoRequest())).vocab_size > 0
    finally:
        await server.stop()


# -- request ids in logs ----------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_request_id_reaches_json_logs(verifier):
    server, _ = verifier
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter("verifier"))
    logger = logging.getLogger("specdec")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        async with channel_to(server) as ch:
            stub = VerifierServiceStub(ch)
            await rpc_error(stub.Verify(VerifyRequest(session_id="none", tree=DraftTree(tokens=[1], parents=[-1])),
                                        metadata=(("x-request-id", "req-42"),)))
            token = request_id_var.set("outer-7")           # passed on by open_channel
            try:
                await stub.GetInfo(VerifierGetInfoRequest())
            finally:
                request_id_var.reset(token)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    rpc = {(r["request_id"], r["method"], r["code"]) for r in lines if r["msg"] == "rpc"}
    assert ("req-42", "specdec.v1.VerifierService/Verify", "NOT_FOUND") in rpc
    assert ("outer-7", "specdec.v1.VerifierService/GetInfo", "OK") in rpc
    assert all({"ts", "level", "service", "msg", "request_id"} <= set(r) for r in lines)


def test_python_warnings_are_json_log_lines_too():
    """A library's warning (a deprecation) is a log record like any other, so a
    service's stderr stays one JSON object a line for log shippers."""
    code = ("import warnings; from specdec.serving.logs import configure_logging; configure_logging('verifier'); "
            "warnings.warn('an old keyword', FutureWarning)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    [record] = [json.loads(line) for line in proc.stderr.splitlines()]
    assert record["level"] == "WARNING" and record["service"] == "verifier" and "an old keyword" in record["msg"]


# -- the CLI ----------------------------------------------------------------------------------------------------------
def test_cli_flags_and_env(monkeypatch):
    from specdec.cli.main import build_parser
    from specdec.cli.serve import server_config_from

    monkeypatch.setenv("SPECDEC_PORT", "6001")
    monkeypatch.setenv("SPECDEC_METRICS_PORT", "off")
    monkeypatch.setenv("SPECDEC_AUTH_TOKEN", "tok")
    monkeypatch.setenv("SPECDEC_HOST", "0.0.0.0")
    monkeypatch.setenv("SPECDEC_SOLO_THREADS", "2")
    args = build_parser().parse_args(["verifier", "serve"])
    cfg = server_config_from(args)
    assert (cfg.host, cfg.port, cfg.metrics_port, cfg.auth_token) == ("0.0.0.0", 6001, None, "tok")
    assert args.solo_threads == 2 and build_parser().parse_args(["drafter", "serve"]).solo_threads == 2
    args = build_parser().parse_args(["drafter", "serve", "--port", "0", "--metrics-port", "7"])
    assert (server_config_from(args).port, server_config_from(args).metrics_port) == (0, 7)


@pytest.mark.parametrize("argv, words", [
    (["verifier", "serve", "--target", "/no/such/dir"], "target model directory /no/such/dir has no config.json"),
    (["drafter", "serve", "--eagle", "/no/such/head", "--target", "/no/such/dir"], "EAGLE head directory"),
    (["drafter", "serve", "--draft-lm", "/no/such/lm"], "draft LM directory"),
    (["drafter", "serve", "--ngram", "--vocab-size", "0"], "--vocab-size must be >= 1"),
    (["verifier", "serve", "--max-sessions", "0"], "--max-sessions must be >= 1"),
    (["drafter", "serve", "--ngram", "--vocab-size", "8", "--solo-threads", "-1"], "--solo-threads must be >= 0"),
    (["verifier", "serve", "--tp", "2", "--solo-threads", "2"], "--solo-threads needs --tp 1"),
])
def test_cli_bad_setup_is_one_line_exit_2(argv, words, capsys):
    from specdec.cli.main import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


def test_cli_verifier_process_announces_serves_and_drains_on_sigterm(tiny_family, tmp_path):
    ready_file = tmp_path / "ready.json"
    cmd = [sys.executable, "-m", "specdec.cli.main", "verifier", "serve", "--target", str(tiny_family["target"]),
           "--port", "0", "--metrics-port", "0", "--ready-file", str(ready_file), "--drain-s", "120"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        listening = json.loads(proc.stdout.readline())
        assert listening["event"] == "listening" and listening["port"] > 0 and listening["metrics_port"] > 0
        deadline = time.monotonic() + 60
        while not ready_file.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert json.loads(ready_file.read_text()) == listening

        async def probe():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{listening['port']}") as ch:
                return await health(ch, "readiness")
        assert asyncio.run(probe()) == SERVING

        proc.send_signal(signal.SIGTERM)
        # nothing open: it must exit without waiting out its 120 s grace
        assert proc.wait(timeout=60) == 0
        logs = [json.loads(line) for line in proc.stderr.read().splitlines()]
        assert [r["msg"] for r in logs if r["msg"] in ("ready", "draining", "stopped")] == ["ready", "draining", "stopped"]
        assert all(r["service"] == "verifier" for r in logs)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
