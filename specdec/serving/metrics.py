"""Prometheus metrics of the specdec services (names from DESIGN.md §7).

One registry per process (``REGISTRY``) and every metric object created once,
at import: several servers in one process (the tests start many) share them,
and each server's HTTP endpoint serves the same registry. In a deployment each
role runs in its own process, so a process's series describe that server.

Who counts what, so that summing over pods never counts a thing twice:
- the orchestrator owns the per-request speculative figures: requests, TTFT,
  inter-token latency, request duration, drafts, draft/accepted tokens and
  accepted tokens per position;
- the verifier and the drafter report what only they see: their compute time
  per call (``specdec_verify_duration_seconds``,
  ``specdec_draft_duration_seconds``), sessions, KV bytes and evictions, and
  their prefix caches (``specdec_prefix_cache_*{role}``: lookups, hits, hit
  and saved prefill tokens, evictions, cached tokens);
- every server's interceptor records each RPC (``specdec_rpc_duration_seconds``,
  ``specdec_rpcs_total``) and the in-flight count ``specdec_queue_depth``.
"""

from __future__ import annotations

import threading
import weakref

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import start_http_server as _start_http_server
from prometheus_client import PlatformCollector, ProcessCollector

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)

# Seconds: from a fraction of a millisecond (one draft step of a small head)
# to tens of seconds (a long prompt on a big target).
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SLOW = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# -- speculative decoding (counted by the orchestrator) -------------------------
DRAFT_TOKENS = Counter("specdec_draft_tokens_total", "Draft tokens proposed (tree nodes minus roots).",
                       registry=REGISTRY)
ACCEPTED_TOKENS = Counter("specdec_accepted_tokens_total", "Draft tokens accepted by the target.",
                          registry=REGISTRY)
ACCEPTED_PER_POSITION = Counter("specdec_accepted_tokens_per_position_total",
                                "Cycles that accepted a draft token at this depth (1-based).",
                                ["position"], registry=REGISTRY)
DRAFTS = Counter("specdec_drafts_total", "Draft/verify cycles.", registry=REGISTRY)
REQUESTS = Counter("specdec_requests_total", "Generation requests by final status.", ["status"],
                   registry=REGISTRY)
REQUEST_DURATION = Histogram("specdec_request_duration_seconds", "Wall time of a generation request.",
                             buckets=_SLOW, registry=REGISTRY)
TTFT = Histogram("specdec_ttft_seconds", "Time to the first generated token.", buckets=_SLOW,
                 registry=REGISTRY)
INTER_TOKEN_LATENCY = Histogram("specdec_inter_token_latency_seconds",
                                "Time between streamed tokens (per token, cycles spread over their tokens).",
                                buckets=_FAST, registry=REGISTRY)

# -- engine time (verifier and drafter services) ---------------------------------
DRAFT_DURATION = Histogram("specdec_draft_duration_seconds", "Drafter compute per Draft call (commit + tree).",
                           buckets=_FAST, registry=REGISTRY)
DRAFT_AHEAD_DURATION = Histogram("specdec_draft_ahead_duration_seconds",
                                 "Drafter compute per DraftAhead call (commit + trees drafted one round ahead).",
                                 buckets=_FAST, registry=REGISTRY)
AHEAD_CYCLES = Counter("specdec_ahead_cycles_total",
                       "Cycles that drafted one round ahead, by whether the verified outcome had a tree ready.",
                       ["outcome"], registry=REGISTRY)
VERIFY_DURATION = Histogram("specdec_verify_duration_seconds", "Verifier compute per Verify call.",
                            buckets=_FAST, registry=REGISTRY)
PREFILL_DURATION = Histogram("specdec_prefill_duration_seconds", "Compute per Prefill call.", ["role"],
                             buckets=_SLOW, registry=REGISTRY)

# -- RPCs (server interceptor) ---------------------------------------------------
RPC_DURATION = Histogram("specdec_rpc_duration_seconds", "Server-side time per RPC.", ["service", "method"],
                         buckets=_FAST, registry=REGISTRY)
RPCS = Counter("specdec_rpcs_total", "RPCs served, by status code.", ["service", "method", "code"],
               registry=REGISTRY)
QUEUE_DEPTH = Gauge("specdec_queue_depth", "RPCs in flight (queued or running).", ["role"],
                    registry=REGISTRY)

# -- sessions ---------------------------------------------------------------------
ACTIVE_SESSIONS = Gauge("specdec_active_sessions", "Open sessions.", ["role"], registry=REGISTRY)
KV_CACHE_BYTES = Gauge("specdec_kv_cache_bytes", "KV cache bytes held by open sessions.", ["role"],
                       registry=REGISTRY)
SESSIONS_EVICTED = Counter("specdec_sessions_evicted_total", "Sessions dropped after their idle TTL.", ["role"],
                           registry=REGISTRY)


# -- prefix caches (verifier and drafter: ``specdec.model.prefix_cache``) ---------------------
PREFIX_LOOKUPS = Counter("specdec_prefix_cache_lookups_total", "Prefills that looked their prompt up in the prefix cache.",
                         ["role"], registry=REGISTRY)
PREFIX_HITS = Counter("specdec_prefix_cache_hits_total", "Prefix-cache lookups that found at least one block.",
                      ["role"], registry=REGISTRY)
PREFIX_HIT_TOKENS = Counter("specdec_prefix_cache_hit_tokens_total", "Prompt tokens found in the prefix cache.",
                            ["role"], registry=REGISTRY)
PREFIX_SAVED_TOKENS = Counter("specdec_prefix_cache_saved_prefill_tokens_total",
                              "Prefill tokens loaded from the prefix cache instead of computed.", ["role"],
                              registry=REGISTRY)
PREFIX_EVICTIONS = Counter("specdec_prefix_cache_evictions_total",
                           "Prefix-cache blocks evicted (its token budget, or room for sessions).", ["role"],
                           registry=REGISTRY)
PREFIX_TOKENS = Gauge("specdec_prefix_cache_tokens", "Tokens held by the prefix cache.", ["role"], registry=REGISTRY)


class RoleSummed:
    """A server's figures that gauges sum over the role's live servers: several
    servers of one role in a process each hold their own, and a gauge one of
    them set would read another's. ``GAUGES``: (gauge, attribute) pairs; the
    owner sets the attributes, scrapes read the last values and never touch an
    engine; ``close`` takes the server out of the sums."""

    GAUGES: tuple = ()
    _live: dict[tuple[type, str], weakref.WeakSet] = {}
    _lock = threading.Lock()

    def __init__(self, role: str):
        self.role = role
        for _, attr in self.GAUGES:
            setattr(self, attr, 0)
        key = (type(self), role)
        with self._lock:
            if key not in self._live:
                peers = self._live[key] = weakref.WeakSet()
                for gauge, attr in self.GAUGES:
                    gauge.labels(role).set_function(lambda attr=attr: sum(getattr(s, attr) for s in list(peers)))
            self._live[key].add(self)

    def close(self) -> None:
        for _, attr in self.GAUGES:
            setattr(self, attr, 0)
        with self._lock:
            self._live[(type(self), self.role)].discard(self)


class PrefixStats(RoleSummed):
    """One server's prefix cache into the per-role series: ``update`` adds what
    its counters gained since the last call and holds what the cache holds
    (the tokens gauge, summed over the role's live servers)."""

    COUNTERS = ((PREFIX_LOOKUPS, "lookups"), (PREFIX_HITS, "hits"), (PREFIX_HIT_TOKENS, "hit_tokens"),
                (PREFIX_SAVED_TOKENS, "saved_tokens"), (PREFIX_EVICTIONS, "evictions"))
    GAUGES = ((PREFIX_TOKENS, "tokens"),)

    def __init__(self, role: str):
        super().__init__(role)
        self._seen: dict[str, int] = {}

    def update(self, stats, tokens: int) -> None:
        """``stats``: the cache's ``CacheStats``; ``tokens``: what it holds now."""
        for counter, name in self.COUNTERS:
            now = getattr(stats, name)
            gained = now - self._seen.get(name, 0)
            if gained > 0:
                counter.labels(self.role).inc(gained)
            self._seen[name] = now
        self.tokens = tokens


class SessionStats(RoleSummed):
    """Session figures of one server, summed per role into the gauges (the
    owner updates them after each engine call, from its worker thread)."""

    GAUGES = ((ACTIVE_SESSIONS, "active"), (KV_CACHE_BYTES, "kv_bytes"))

    def update(self, active: int, kv_bytes: int = 0) -> None:
        self.active, self.kv_bytes = active, kv_bytes


def start_metrics_server(port: int, host: str):
    """Serve ``REGISTRY`` over HTTP; returns the WSGI server (``.server_port``)."""
    server, _thread = _start_http_server(port, addr=host, registry=REGISTRY)
    return server
