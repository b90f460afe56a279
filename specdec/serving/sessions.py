"""A table of per-request sessions with a cap, idle-TTL eviction and leases.

Used by the verifier and drafter engines: each session owns its KV cache, so
evicting one frees its memory. Thread-safe; a session is touched on every use.

A session opened by an orchestrator carries that orchestrator's id (its
*owner*) and a lease of ``lease_s`` seconds, renewed by every use and by the
owner's ``renew`` (the Renew RPC, about once a second): a session whose lease
lapsed belongs to an orchestrator that is gone and is evicted like an idle
one, seconds after the owner died instead of after the idle TTL. A session
without an owner (tools and tests calling the backends directly) has no
lease and lives until it is released or idle for ``ttl_s``; an owned one is
kept as long as its owner renews it (the owner releases it when its request
ends), whatever the idle TTL.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Generic, Iterator, TypeVar

from specdec.request.errors import InvalidArgument, NotFound, ResourceExhausted
from specdec.request.params import shown

S = TypeVar("S")


DEFAULT_LEASE_S = 4.0       # the owner renews about every second: a few missed renewals are tolerated


@dataclass
class _Entry(Generic[S]):
    value: S
    last_used: float = field(default_factory=time.monotonic)
    owner: str = ""             # the orchestrator holding the session's lease; "" for none

    def expired(self, now: float, ttl_s: float, lease_s: float) -> bool:
        return now - self.last_used > (lease_s if self.owner else ttl_s)


class SessionTable(Generic[S]):
    def __init__(self, max_sessions: int = 64, ttl_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic, lease_s: float = DEFAULT_LEASE_S):
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.lease_s = lease_s
        self._clock = clock
        self._entries: dict[str, _Entry[S]] = {}
        self._evicted: set[str] = set()
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, sid: str) -> bool:
        return sid in self._entries

    def add(self, sid: str, value: S, replace: bool = False) -> None:
        if not sid:
            raise InvalidArgument("session_id must not be empty")
        with self._lock:
            self.evict_idle()
            if sid in self._entries and not replace:
                raise InvalidArgument(f"session_id {shown(sid)} already exists")
            if sid not in self._entries and len(self._entries) >= self.max_sessions:
                raise ResourceExhausted(f"session limit reached ({self.max_sessions} sessions)")
            self._entries[sid] = _Entry(value, self._clock())
            self._evicted.discard(sid)

    def get(self, sid: str) -> S:
        with self._lock:
            entry = self._entries.get(sid)
            if entry is None:
                why = ("was evicted (idle, or its owner stopped renewing its lease)" if sid in self._evicted
                       else "does not exist")
                raise NotFound(f"session {shown(sid)} {why}")
            entry.last_used = self._clock()
            return entry.value

    def lease(self, sid: str, owner: str) -> None:
        """Put a session (just opened) under ``owner``'s lease; "" takes it off any lease."""
        with self._lock:
            entry = self._entries.get(sid)
            if entry is not None:
                entry.owner = owner
                entry.last_used = self._clock()

    def renew(self, owner: str, sids) -> int:
        """Renew ``owner``'s lease on those of ``sids`` it holds here; returns how many."""
        renewed = 0
        with self._lock:
            now = self._clock()
            for sid in sids:
                entry = self._entries.get(sid)
                if entry is not None and entry.owner and entry.owner == owner:
                    entry.last_used = now
                    renewed += 1
        return renewed

    def pop(self, sid: str) -> S | None:
        with self._lock:
            entry = self._entries.pop(sid, None)
            return None if entry is None else entry.value

    def stale(self, ttl_s: float | None = None) -> list[str]:
        """Ids idle for longer than ``ttl_s`` (default: the table's TTL) or whose
        lease lapsed, not evicted yet."""
        ttl = self.ttl_s if ttl_s is None else ttl_s
        with self._lock:
            now = self._clock()
            return [sid for sid, e in self._entries.items() if e.expired(now, ttl, self.lease_s)]

    def evict_idle(self) -> list[str]:
        """Drop sessions idle for longer than the TTL or whose lease lapsed; returns their ids."""
        with self._lock:
            now = self._clock()
            stale = [sid for sid, e in self._entries.items() if e.expired(now, self.ttl_s, self.lease_s)]
            for sid in stale:
                del self._entries[sid]
                self._evicted.add(sid)
            if len(self._evicted) > 10 * max(1, self.max_sessions):
                self._evicted.clear()
            return stale

    def items(self) -> Iterator[tuple[str, S]]:
        with self._lock:
            return iter([(sid, e.value) for sid, e in self._entries.items()])
