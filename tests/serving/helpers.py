"""Start real verifier / drafter servers in-process on 127.0.0.1, port 0.

    server, servicer = await start_verifier(paths, max_sessions=4, session_ttl=0.5)
    server, servicer = await start_drafter(paths, "eagle", limits=TreeParams(...))
    ...
    await server.stop()

``paths`` is a tiny family (the ``tiny_family`` fixture). Keyword arguments
are split by name: ``ServerConfig`` fields (``auth_token``, ``tls_cert``,
``metrics_port``...) configure the server, ``max_sessions`` / ``session_ttl``
the engine's session table, the rest the service config. ``warm=False``
starts the server without loading the model (health: not ready; RPCs:
UNAVAILABLE); ``await load_verifier(servicer, paths)`` /
``load_drafter(...)`` and ``server.set_ready(True)`` finish the job.
Importable from any test as ``serving.helpers`` (tests/ is on sys.path).

Waiting for sessions to close: ``SessionWatch`` (a running stack's backends)
and ``evicted`` / ``eventually`` (one servicer) poll to a generous deadline and
return as soon as the condition holds. A session that closed must also not
have been *evicted*: the sweep frees an orchestrator's session seconds after
its lease lapses, released or not, so "no session left" alone would pass with
the release gone.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import fields

import grpc

from specdec.serving.server import ClientTls, RunningServer, ServerConfig, open_channel, start_server

_SERVER_FIELDS = {f.name for f in fields(ServerConfig)}


def _split(cfg: dict) -> tuple[ServerConfig, dict, dict]:
    server = ServerConfig(**{k: cfg.pop(k) for k in list(cfg) if k in _SERVER_FIELDS})
    engine = dict(max_sessions=cfg.pop("max_sessions", 8), session_ttl=cfg.pop("session_ttl", 600.0),
                  prefix_cache_tokens=cfg.pop("prefix_cache_tokens", 0),
                  prefix_cache_exact=cfg.pop("prefix_cache_exact", False))
    return server, engine, cfg


def verifier_builder(paths, max_sessions: int = 8, session_ttl: float = 600.0, dtype: str = "float32",
                     prefix_cache_tokens: int = 0, prefix_cache_exact: bool = False):
    def build():
        from specdec.model.loading import ModelSpec
        from specdec.model.loading import default_grammar_tokenizer
        from verifier.engine import TargetModel, VerifierEngine

        return VerifierEngine(TargetModel(ModelSpec(str(paths["target"]), dtype=dtype)),
                              max_sessions=max_sessions, ttl_s=session_ttl,
                              grammar_tokenizer=default_grammar_tokenizer(None, paths["target"]),
                              prefix_cache_tokens=prefix_cache_tokens, prefix_cache_exact=prefix_cache_exact)
    return build


def oracle_dir(paths):
    """A copy of the target to serve as a draft LM, calibrated for greedy
    acceptance as ``specdec train calibrate`` would find (its top token is
    always right): the sharp value temperature makes its node values say so."""
    import json
    import shutil
    from pathlib import Path

    target = Path(paths["target"])
    oracle = target.parent / "oracle"
    if not oracle.is_dir():
        tmp = target.parent / "oracle.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(target, tmp)
        (tmp / "calibration.json").write_text(json.dumps({"greedy_value_temperature": 0.05}))
        tmp.rename(oracle)
    return oracle


def drafter_builder(paths, kind: str, max_sessions: int = 8, session_ttl: float = 600.0, prefix_cache_tokens: int = 0,
                    prefix_cache_exact: bool = False):
    def build():
        from specdec.model.loading import default_grammar_tokenizer

        drafter = _drafter(paths, kind, max_sessions, session_ttl)
        drafter.grammar_tokenizer = default_grammar_tokenizer(None, paths["target"])     # `drafter serve`'s default
        drafter.use_prefix_cache(prefix_cache_tokens, prefix_cache_exact)
        return drafter
    return build


def _drafter(paths, kind: str, max_sessions: int, session_ttl: float):
    sessions = dict(max_sessions=max_sessions, ttl_s=session_ttl)
    if kind == "eagle":
        from drafter.eagle.eagle2 import EagleDrafter

        return EagleDrafter(paths["eagle"], paths["target"], **sessions)
    if kind == "draft-lm":
        from drafter.draft_lm import DraftLmDrafter
        from specdec.model.loading import ModelSpec

        return DraftLmDrafter(ModelSpec(str(paths["draft-lm"])), **sessions)
    if kind == "oracle":        # the target itself as draft LM: its greedy drafts are always accepted
        from drafter.draft_lm import DraftLmDrafter
        from specdec.model.loading import ModelSpec

        return DraftLmDrafter(ModelSpec(str(oracle_dir(paths))), **sessions)
    if kind == "medusa":      # the family's paths must hold "medusa" (tests/drafter/test_medusa.py writes one)
        from drafter.medusa import load_medusa_drafter

        return load_medusa_drafter(paths["medusa"], paths["target"], **sessions)
    if kind in ("hydra", "hydra-prefix"):     # the family's paths must hold it (prefix-mlp heads: "hydra-prefix")
        from drafter.hydra import load_hydra_drafter

        return load_hydra_drafter(paths[kind], paths["target"], **sessions)
    if kind == "ngram":
        from drafter.ngram import NgramDrafter
        from specdec.model.loading import read_config

        return NgramDrafter(int(read_config(paths["target"])["vocab_size"]), **sessions)
    raise ValueError(f"unknown drafter kind {kind!r}")


async def start_verifier(paths, warm: bool = True, **cfg) -> tuple[RunningServer, object]:
    from verifier.service import VerifierService, VerifierServiceConfig

    server_cfg, engine, rest = _split(dict(cfg))
    servicer = VerifierService(VerifierServiceConfig(**rest))
    server = await start_server(server_cfg, [servicer.registration()], "verifier")
    if warm:
        await load_verifier(server, servicer, paths, **engine)
    return server, servicer


async def load_verifier(server, servicer, paths, **kw) -> None:
    await servicer.load(verifier_builder(paths, **kw))
    server.set_ready(True)


async def start_drafter(paths, kind: str = "eagle", warm: bool = True, **cfg) -> tuple[RunningServer, object]:
    from drafter.service import DrafterService, DrafterServiceConfig

    server_cfg, engine, rest = _split(dict(cfg))
    servicer = DrafterService(DrafterServiceConfig(**rest))
    server = await start_server(server_cfg, [servicer.registration()], "drafter")
    if warm:
        await load_drafter(server, servicer, paths, kind, **engine)
    return server, servicer


async def load_drafter(server, servicer, paths, kind: str, **kw) -> None:
    await servicer.load(drafter_builder(paths, kind, **kw))
    server.set_ready(True)


def channel_to(server: RunningServer, tls: ClientTls | None = None, token: str | None = None):
    """An aio channel to ``server`` (use ``async with``)."""
    return open_channel(f"127.0.0.1:{server.port}", tls=tls, token=token)


async def rpc_error(awaitable) -> grpc.aio.AioRpcError:
    """The AioRpcError an RPC ends with; AssertionError if it succeeds."""
    try:
        result = await awaitable
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError(f"the RPC succeeded ({type(result).__name__}); an error status was expected")


def evicted(servicer) -> set[str]:
    """Ids of the sessions ``servicer``'s table evicted (idle past its TTL, or
    its owner's lease lapsed) rather than had released."""
    return set(servicer.sessions._evicted)


async def eventually(predicate, timeout: float = 30.0, every_s: float = 0.01) -> bool:
    """Poll ``predicate()`` on the event loop until it holds (True, at once) or
    ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(every_s)
    return True


class SessionWatch:
    """Sessions of a running stack's backends (``running_stack.Stack``), from
    now on: ``opened(count)`` waits until each holds ``count``; ``released()``
    until none holds any -> {name: sessions not released}: those still open
    plus those the sweep evicted since the watch began (0 each: all released)."""

    def __init__(self, stack, *names: str):
        self.stack, self.names = stack, names
        self.before = {name: evicted(stack.servicer(name)) for name in names}

    def opened(self, count: int = 1, timeout: float = 30.0) -> dict[str, int]:
        return self.stack.wait_sessions(*self.names, count=count, timeout=timeout)

    def released(self, timeout: float = 30.0) -> dict[str, int]:
        left = self.stack.wait_sessions(*self.names, count=0, timeout=timeout)
        return {name: left[name] + len(evicted(self.stack.servicer(name)) - self.before[name])
                for name in self.names}
