"""Tensor-parallel verifier: the target sharded across ranks with torch.distributed.

Every rank loads the target with transformers' own tensor-parallel plan
(``from_pretrained(dir, tp_plan="auto")``: attention heads and MLP columns are
split, activations are all-reduced inside the forward) and holds an identical
``VerifierEngine`` over its shard — each rank's KV cache holds its own heads.
Rank 0 serves gRPC; every state-changing engine call is broadcast first and
then executed by all ranks in lockstep, so sessions, caches, seeds and
evictions stay identical and every rank reaches each collective together.
(Any divergence — a session evicted on one rank only, a seed drawn per rank —
would leave ranks waiting in different collectives.) Backends: gloo on CPU,
NCCL on GPUs. The TP degree must divide the attention and key/value heads.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch
import torch.distributed as dist

from specdec.model.loading import ModelSpec, load_causal_lm, read_config
from specdec.request.errors import SpecdecError
from specdec.request.lookahead import LookaheadParams
from specdec.request.params import SamplingParams
from specdec.tree.placed import host_tree
from verifier.engine import TargetModel, VerifierEngine

log = logging.getLogger("specdec.verifier.tp")

BROADCAST = ("prefill", "verify", "verify_lookahead", "verify_batch", "rollback", "release")
_STOP = "__stop__"


def check_tp_degree(model_dir: str, tp: int) -> None:
    cfg = read_config(model_dir)
    heads = cfg.get("num_attention_heads", 0)
    kv_heads = cfg.get("num_key_value_heads", heads)
    if tp < 1 or heads % tp or kv_heads % tp:
        raise ValueError(f"--tp {tp} must divide the target's attention heads ({heads}) and "
                         f"key/value heads ({kv_heads})")


def init_process_group(rank: int, world: int, master_port: int, backend: str | None = None) -> None:
    os.environ.update(MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=str(master_port),
                      RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)


def load_sharded_target(spec: ModelSpec) -> TargetModel:
    """This rank's shard of the target (the process group must be initialised)."""
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(tp_plan="auto", tp_size=dist.get_world_size())
    return TargetModel(spec, model=load_causal_lm(spec, distributed_config=config))


class ReplicatedVerifier:
    """Rank 0's engine: same interface as VerifierEngine, calls run on all ranks."""

    def __init__(self, engine: VerifierEngine, ttl_s: float):
        # Engines on every rank never evict by themselves (infinite TTL): only
        # rank 0's clock decides, through evict_idle().
        self.engine = engine
        self.ttl_s = ttl_s

    def __getattr__(self, name):              # read-only state: sessions, target, kv_bytes...
        return getattr(self.engine, name)

    def _call(self, name: str, *args, **kwargs):
        dist.broadcast_object_list([(name, args, kwargs)], src=0)
        return getattr(self.engine, name)(*args, **kwargs)

    def prefill(self, sid: str, prompt: list[int], params: SamplingParams, max_new_tokens: int = 0,
                resume: bool = False, logprobs: int | None = None, prompt_tokens: int = 0,
                feature_layers: tuple[int, ...] = (), prompt_logprobs: int | None = None, cache_salt: str = ""):
        if params.seed is None:               # every rank must draw the same random numbers
            params = replace(params, seed=int.from_bytes(os.urandom(8), "little") >> 1)
        return self._call("prefill", sid, prompt, params, max_new_tokens, resume, logprobs, prompt_tokens,
                          tuple(feature_layers), prompt_logprobs, cache_salt)

    def verify(self, sid, tree):
        return self._call("verify", sid, host_tree(tree))      # every rank gets the tree's host lists

    def verify_lookahead(self, sid, depth):
        return self._call("verify_lookahead", sid, depth)

    def verify_batch(self, items):
        return self._call("verify_batch", items)

    def rollback(self, sid, length):
        return self._call("rollback", sid, length)

    def release(self, sid):
        return self._call("release", sid)

    def evict_idle(self) -> list[str]:
        """Evict by rank 0's clock, then release the same ids everywhere."""
        stale = self.engine.sessions.stale(self.ttl_s)
        for sid in stale:
            self.release(sid)
        return stale

    def shutdown(self) -> None:
        """Stop the other ranks and leave the process group (idempotent)."""
        if not dist.is_initialized():
            return
        dist.broadcast_object_list([(_STOP, (), {})], src=0)
        for p in getattr(self, "_procs", []):
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        dist.destroy_process_group()


def follow(engine: VerifierEngine) -> None:
    """Ranks > 0: execute rank 0's calls until told to stop."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        name, args, kwargs = box[0]
        if name == _STOP:
            return
        if name not in BROADCAST:
            log.error("ignoring unknown call %r from rank 0", name)
            continue
        try:
            getattr(engine, name)(*args, **kwargs)
        except SpecdecError:
            pass                              # rank 0 raised the same error from the same state


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, spec: ModelSpec, max_sessions: int,
            kv_budget_bytes: int | None, threads: int, prefix_cache_tokens: int = 0,
            prefix_cache_exact: bool = False, lookahead: LookaheadParams = LookaheadParams()) -> None:
    if threads:
        torch.set_num_threads(threads)
    init_process_group(rank, world, port)
    try:
        follow(VerifierEngine(load_sharded_target(spec), max_sessions, ttl_s=float("inf"),
                              kv_budget_bytes=kv_budget_bytes, prefix_cache_tokens=prefix_cache_tokens,
                              prefix_cache_exact=prefix_cache_exact, lookahead=lookahead))
    finally:
        dist.destroy_process_group()


def start_ranks(tp: int, spec: ModelSpec, max_sessions: int = 64, ttl_s: float = 600.0,
                kv_budget_bytes: int | None = None, threads: int = 0, tree_sizing: str = "fixed",
                prefix_cache_tokens: int = 0, prefix_cache_exact: bool = False,
                lookahead: LookaheadParams = LookaheadParams()) -> ReplicatedVerifier:
    """Start ranks 1..tp-1 as processes, become rank 0, load this rank's shard.
    ``ReplicatedVerifier.shutdown()`` stops them again. ``tree_sizing``: rank
    0's (it cuts trees before they are broadcast: ``VerifierEngine``);
    ``prefix_cache_tokens``, ``prefix_cache_exact``: every rank's (they look up and evict in lockstep);
    ``lookahead``: every rank's (lookahead decoding steps run on each, from the same state)."""
    import torch.multiprocessing as mp

    check_tp_degree(spec.path, tp)
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, tp, port, spec, max_sessions, kv_budget_bytes, threads,
                                               prefix_cache_tokens, prefix_cache_exact, lookahead), daemon=True)
             for r in range(1, tp)]
    for p in procs:
        p.start()
    init_process_group(0, tp, port)
    engine = VerifierEngine(load_sharded_target(spec), max_sessions, ttl_s=float("inf"),
                            kv_budget_bytes=kv_budget_bytes, tree_sizing=tree_sizing,
                            prefix_cache_tokens=prefix_cache_tokens, prefix_cache_exact=prefix_cache_exact,
                            lookahead=lookahead)
    verifier = ReplicatedVerifier(engine, ttl_s)
    verifier._procs = procs
    return verifier


def launch(tp: int, spec: ModelSpec, rank0_main, max_sessions: int = 64, ttl_s: float = 600.0,
           threads: int = 0):
    """Run ``rank0_main(ReplicatedVerifier)`` as rank 0 of a TP group of ``tp``."""
    verifier = start_ranks(tp, spec, max_sessions, ttl_s, threads=threads)
    try:
        return rank0_main(verifier)
    finally:
        verifier.shutdown()
