"""``specdec bench --grpc``: the same methods through the three services.

One stack per drafter kind the methods need (verifier + drafter +
orchestrator as separate processes on 127.0.0.1, free ports, started and
stopped by the bench with ``specdec.procs``, as ``specdec up`` does); the bench calls the
orchestrator with the client SDK, so every figure includes the real wire path.
Each speculative method M runs as ``M@grpc``; ``vanilla@grpc`` (method
VANILLA on the first stack) measures the services' own per-token overhead.
With ``--lookahead N,...`` each stack also gets one orchestrator per N that
drafts one round ahead, over the same verifier and drafter, and each model
method runs through it as ``M@grpc-aheadN``.
The services use the bench's torch thread count, so in-process and gRPC
methods get the same compute. With ``--pin`` (``cfg.pin``) the verifier runs
on one core and the drafter on the other, one torch thread each, as on
devices of their own (the orchestrators and the bench's client float), and
the in-process methods run on the verifier's core (``bench.suite``). With
``--compare-plane`` each of those orchestrators (on the direct plane, the
default: the verifier runs the loop and calls the drafter itself) gets a twin
on the relay plane (``METHOD@grpc-relay``, ``METHOD@grpc-aheadN-relay``:
every tree and commit through the orchestrator). With
``--compare-unary`` each stack also gets an orchestrator that sends every
step as a unary call (``METHOD@grpc-unary``): the session streams' gain,
measured in the same run.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from specdec import procs
from specdec.bench.runner import (AHEAD_SUFFIX, GRPC_SUFFIX, RELAY_SUFFIX, SELF_DRAFTED, SPECULATIVE, UNARY_SUFFIX, BenchConfig,
                                  Prompt, Sample, method_tree)
from specdec.client import SpecdecClient, SpecdecClientError
from specdec.request.errors import UsageError

REQUEST_TIMEOUT_S = 600.0


class GrpcMethod:
    def __init__(self, client, method: str, cfg: BenchConfig, proposals: str = "auto"):
        self.client, self.method, self.cfg, self.proposals = client, method, cfg, proposals

    def run(self, prompt: Prompt, seed: int | None) -> Sample:
        tree = self.cfg.tree
        t = time.perf_counter()
        try:
            done = self.client.complete(      # the token ids every in-process method runs
                prompt.ids, timeout=REQUEST_TIMEOUT_S, max_new_tokens=self.cfg.max_new_tokens,
                temperature=self.cfg.temperature, seed=None if self.cfg.temperature == 0 else seed,
                method=self.method, total_tokens=tree.total_tokens, depth=tree.depth, expand_k=tree.expand_k,
                proposals=self.proposals)
        except SpecdecClientError as exc:
            raise UsageError(f"--grpc: {self.method} request failed: {exc}") from None
        wall = time.perf_counter() - t
        s = done.stats
        return Sample(tokens=list(done.token_ids), wall_s=wall, cycles=s.cycles, committed=round(s.tau * s.cycles),
                      accepted_counts=list(s.accepted_per_position), draft_s=s.draft_s, verify_s=s.verify_s,
                      network_s=s.network_s, ahead_hits=s.ahead_hits, wire_bytes=s.wire_bytes,
                      ahead_draft_s=s.ahead_draft_s, ahead_committed=s.ahead_committed)


def eagle_head(cfg: BenchConfig, kind: str) -> str | None:
    """The EAGLE head directory a drafter of ``kind`` runs (None: no EAGLE head)."""
    return {"eagle": cfg.eagle, "eagle3": cfg.eagle3}.get(kind)


def drafter_argv(cfg: BenchConfig, kind: str) -> list[str]:
    tree = cfg.tree
    limits = ["--max-total-tokens", str(max(64, tree.total_tokens)), "--max-depth", str(max(8, tree.depth)),
              "--max-expand-k", str(max(10, tree.expand_k))]
    if kind in ("eagle", "eagle3"):                  # `serve drafter --eagle` tells the head's version
        budget = ["--total-tokens", str(tree.total_tokens), "--depth", str(tree.depth),
                  "--expand-k", str(tree.expand_k)]
        # no --dtype: the head drafts in float32 whatever the target's, as in process and under `specdec up`
        # (whose head layers follow --weights w8a8 too)
        return ["--eagle", eagle_head(cfg, kind), "--target", cfg.target, "--device", cfg.device,
                "--weights", cfg.weights, "--compile", cfg.compile, *limits, *budget]     # (its default tree: the one drafted whole)
    if kind == "medusa":
        return ["--medusa", cfg.medusa, "--target", cfg.target, "--dtype", cfg.dtype, "--device", cfg.device, *limits]
    if kind == "hydra":
        return ["--hydra", cfg.hydra, "--target", cfg.target, "--dtype", cfg.dtype, "--device", cfg.device, *limits]
    if kind == "ngram":
        return ["--ngram", "--target", cfg.target, *limits]
    if kind == "draft-lm":
        return ["--draft-lm", cfg.draft_lm, "--dtype", cfg.dtype, "--weights", cfg.weights, "--device", cfg.device,
                "--compile", cfg.compile, *limits]
    raise ValueError(f"unknown drafter kind {kind!r}")


@contextmanager
def _threads_env(threads: int) -> Iterator[None]:
    """Children inherit OMP_NUM_THREADS = ``threads``."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old


def orchestrator_variants(cfg: BenchConfig) -> dict[str, list[str]]:
    """{method-name suffix: extra orchestrator flags}: the plain orchestrator
    (suffix ""), one per ``cfg.lookahead`` value, with ``cfg.compare_plane`` each
    of those on the relay plane too, and with ``cfg.compare_unary`` one with
    unary steps."""
    variants = {"": []}
    for lookahead in cfg.lookahead:
        variants[f"{AHEAD_SUFFIX}{lookahead}"] = ["--lookahead", str(lookahead)]
    if cfg.compare_plane:           # each of those again on the relay plane
        for suffix, flags in list(variants.items()):
            variants[suffix + RELAY_SUFFIX] = [*flags, "--plane", "relay"]
    if cfg.compare_unary:
        variants[UNARY_SUFFIX] = ["--unary-steps"]
    return variants


def start_stack(cfg: BenchConfig, kind: str, children: list) -> dict[str, str]:
    """Start verifier, drafter and orchestrators (appended to children as they
    start, so the caller stops them whatever happens): one orchestrator per
    ``orchestrator_variants``, all over the same verifier and drafter; return
    {suffix: orchestrator address}."""
    import torch        # here, not at the top: the `specdec bench` parser imports this module, torch-free

    internal = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "off", "--drain-s", "1",
                "--log-level", "WARNING"]
    deadline = time.monotonic() + cfg.startup_timeout_s
    mine = []
    # The same core budget as the in-process methods, split between the two
    # torch processes (oversubscribed OpenMP threads spin on each other); the
    # verifier takes the whole budget while one session is open, when the two
    # alternate (procs.solo_threads), unless an orchestrator drafts ahead:
    # then the drafter computes during verifies. Pinned: one core each.
    # (lookahead decoding has no drafter process: the verifier drafts, on the whole budget)
    budget = torch.get_num_threads()
    drafted = kind not in SELF_DRAFTED
    share = 1 if cfg.pin else max(1, budget // 2) if drafted else budget
    solo = ["--solo-threads", str(budget)] if share < budget and not cfg.lookahead and not cfg.pin else []
    verifier_core, drafter_core = procs.pinned_cores() if cfg.pin else (None, None)
    with _threads_env(share):
        mine.append(procs.spawn(f"{kind} verifier", ["verifier", "serve", "--target", cfg.target,
                                                     "--dtype", cfg.dtype, "--weights", cfg.weights,
                                                     "--device", cfg.device,
                                                     "--compile", cfg.compile, "--tree-sizing", cfg.tree_sizing,
                                                     "--compile-tree-tokens", str(cfg.tree.total_tokens),
                                                     "--lookahead-wng", str(cfg.lookahead_wng),
                                                     *solo, *internal,
                                                     *procs.feature_layer_flags(eagle_head(cfg, kind), cfg.compile)],
                                env_defaults=procs.solo_env() if solo else None,
                                cores=None if verifier_core is None else frozenset([verifier_core])))
        if drafted:
            mine.append(procs.spawn(f"{kind} drafter", ["drafter", "serve", *drafter_argv(cfg, kind), *internal],
                                    cores=None if drafter_core is None else frozenset([drafter_core])))
        children.extend(mine)
        procs.wait_listening(mine, deadline)
        verifier = mine[0]
        drafter = ["--drafter", mine[1].address] if drafted else []
        orchestrators = {}
        for suffix, flags in orchestrator_variants(cfg).items():
            orchestrators[suffix] = procs.spawn(f"{kind} orchestrator", [
                "orchestrator", "serve", "--verifier", verifier.address, *drafter,
                "--tokenizer", cfg.target, "--max-new-tokens-limit", str(max(2048, cfg.max_new_tokens)),
                "--verify-token-budget", str(cfg.verify_token_budget), "--min-tau", "auto" if cfg.min_tau is None else str(cfg.min_tau),
                *flags, *internal])
    mine.extend(orchestrators.values())
    children.extend(orchestrators.values())
    procs.wait_listening(mine, deadline)
    procs.wait_serving(mine, deadline)
    return {suffix: child.address for suffix, child in orchestrators.items()}


@contextmanager
def grpc_methods(cfg: BenchConfig, names: Sequence[str],
                 progress: Callable[[str], None] | None = None) -> Iterator[dict]:
    """{METHOD@grpc: GrpcMethod} for vanilla and the speculative methods among names,
    with their stacks running until the block exits."""
    def on_sigterm(signum, frame):
        procs.ignore_stop_signals()        # a repeated signal must not cut the stopping short
        raise KeyboardInterrupt             # unwind through the finally below: no orphaned services

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous_int = signal.getsignal(signal.SIGINT)
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    speculative = [n for n in names if n in SPECULATIVE]
    kinds = list(dict.fromkeys(SPECULATIVE[n][0] for n in speculative))
    children: list = []
    clients = {}
    try:
        for kind in kinds:
            if progress is not None:
                progress(f"starting the gRPC services ({kind} drafter)")
            try:
                addresses = start_stack(cfg, kind, children)
            except procs.ChildDied as exc:
                raise UsageError(f"--grpc: {exc}") from None
            for suffix, address in addresses.items():
                clients[kind, suffix] = SpecdecClient(address, timeout=REQUEST_TIMEOUT_S)
        methods = {}
        if kinds and "vanilla" in names:
            methods["vanilla" + GRPC_SUFFIX] = GrpcMethod(clients[kinds[0], ""], "vanilla", cfg)
        for name in speculative:
            kind = SPECULATIVE[name][0]
            tree = method_tree(name, cfg.tree)
            for suffix in orchestrator_variants(cfg):
                # the n-gram drafter has no model to draft ahead with; lookahead decoding no drafter
                if not (kind in ("ngram", *SELF_DRAFTED) and suffix.startswith(AHEAD_SUFFIX)):
                    methods[name + GRPC_SUFFIX + suffix] = GrpcMethod(clients[kind, suffix], tree.method, cfg,
                                                                      tree.proposals)
        yield methods
    finally:
        for client in clients.values():
            client.close()
        procs.stop(children)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, previous_int)
