"""A table of per-request sessions with a cap and idle-TTL eviction.

Used by the verifier and drafter engines: each session owns its KV cache, so
evicting one frees its memory. Thread-safe; a session is touched on every use.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Generic, Iterator, TypeVar

from specdec.errors import InvalidArgument, NotFound, ResourceExhausted

S = TypeVar("S")


@dataclass
class _Entry(Generic[S]):
    value: S
    last_used: float = field(default_factory=time.monotonic)


class SessionTable(Generic[S]):
    def __init__(self, max_sessions: int = 64, ttl_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic):
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
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
                raise InvalidArgument(f"session {sid!r} already exists")
            if sid not in self._entries and len(self._entries) >= self.max_sessions:
                raise ResourceExhausted(f"session limit reached ({self.max_sessions} sessions)")
            self._entries[sid] = _Entry(value, self._clock())
            self._evicted.discard(sid)

    def get(self, sid: str) -> S:
        with self._lock:
            entry = self._entries.get(sid)
            if entry is None:
                why = "was evicted after being idle" if sid in self._evicted else "does not exist"
                raise NotFound(f"session {sid!r} {why}")
            entry.last_used = self._clock()
            return entry.value

    def pop(self, sid: str) -> S | None:
        with self._lock:
            entry = self._entries.pop(sid, None)
            return None if entry is None else entry.value

    def stale(self, ttl_s: float | None = None) -> list[str]:
        """Ids idle for longer than ``ttl_s`` (default: the table's TTL), not evicted yet."""
        ttl = self.ttl_s if ttl_s is None else ttl_s
        with self._lock:
            now = self._clock()
            return [sid for sid, e in self._entries.items() if now - e.last_used > ttl]

    def evict_idle(self) -> list[str]:
        """Drop sessions idle for longer than the TTL; returns their ids."""
        with self._lock:
            now = self._clock()
            stale = [sid for sid, e in self._entries.items() if now - e.last_used > self.ttl_s]
            for sid in stale:
                del self._entries[sid]
                self._evicted.add(sid)
            if len(self._evicted) > 10 * max(1, self.max_sessions):
                self._evicted.clear()
            return stale

    def items(self) -> Iterator[tuple[str, S]]:
        with self._lock:
            return iter([(sid, e.value) for sid, e in self._entries.items()])
