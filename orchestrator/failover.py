"""What the accept loop keeps so that losing a backend costs a re-prefill, never a token.

The committed tokens (prompt + everything the verifier committed) are the
source of truth: a new verifier is opened on them with ``resume`` (their KV is
recomputed, the last token is the pending root again, nothing is sampled), a
new drafter is prefilled with them. An EAGLE drafter also needs the target's
feature row before every committed token but the first; the verifier sent
each of them once (prefill: one per prompt token, each cycle: one per
committed token), so the request keeps those ``Tensor`` messages in a
``FeatureLog`` and concatenates their raw bytes: same dtype, row-major
[n, H] each, so the bytes of [n1, H] then [n2, H] are those of [n1 + n2, H].
No torch needed.

Which failures move a session (``MOVE_CODES``): the backend is gone
(UNAVAILABLE, which connection errors are too) or no longer knows the session
(NOT_FOUND: restarted or evicted). Opening a session may also meet a full
server (RESOURCE_EXHAUSTED): try the next. INVALID_ARGUMENT,
FAILED_PRECONDITION, DEADLINE_EXCEEDED and CANCELLED are never retried.
"""

from __future__ import annotations

import grpc
from prometheus_client import Counter

from specdec.metrics import REGISTRY
from specdec.v1 import common_pb2
from specdec.wire import TENSOR_DTYPES

MOVE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND})
OPEN_MOVE_CODES = MOVE_CODES | {grpc.StatusCode.RESOURCE_EXHAUSTED}
# Failures that end the request whichever backend reports them.
FATAL_CODES = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})
# A request gives up moving a role's session after this many moves (a server
# that keeps forgetting sessions must not keep a request spinning).
MAX_MOVES = 8

# reason: drafters_full | drafters_unavailable (none reachable, or none can take
# the session over) | drafter_error (a status that is no reason to move) |
# moves_exhausted | features (rows that do not continue the log)
FALLBACKS = Counter("specdec_fallback_total",
                    "Requests that asked for drafting but went on (from the start or from some point) as "
                    "plain decoding, by reason.", ["reason"], registry=REGISTRY)
FAILOVERS = Counter("specdec_failovers_total", "Sessions moved to another backend after losing one, by role.",
                    ["role"], registry=REGISTRY)


class FeatureLog:
    """Feature rows ([n, H] ``Tensor`` messages) in the order the verifier sent them."""

    def __init__(self) -> None:
        self.parts: list[common_pb2.Tensor] = []
        self.rows = 0
        self.dtype: str | None = None
        self.hidden: int | None = None

    def add(self, msg: common_pb2.Tensor) -> None:
        """Append one message; ValueError if it does not continue the others."""
        shape = list(msg.shape)
        if len(shape) != 2 or msg.dtype not in TENSOR_DTYPES:
            raise ValueError(f"features must be a 2-D tensor of {', '.join(TENSOR_DTYPES)}, "
                             f"got {msg.dtype or 'no dtype'} {shape}")
        rows, hidden = shape
        if len(msg.data) != rows * hidden * TENSOR_DTYPES[msg.dtype]:
            raise ValueError(f"features of shape {shape} ({msg.dtype}) carry {len(msg.data)} bytes")
        if self.dtype is not None and (msg.dtype, hidden) != (self.dtype, self.hidden):
            raise ValueError(f"features changed from {self.dtype} [*, {self.hidden}] to {msg.dtype} [*, {hidden}]")
        self.dtype, self.hidden = msg.dtype, hidden
        self.parts.append(msg)
        self.rows += rows

    def clear(self) -> None:
        self.parts.clear()
        self.rows = 0

    def tensor(self) -> common_pb2.Tensor | None:
        """All rows as one [rows, H] message; None when nothing was added."""
        if not self.parts:
            return None
        if len(self.parts) == 1:
            return self.parts[0]
        return common_pb2.Tensor(data=b"".join(p.data for p in self.parts), dtype=self.dtype,
                                 shape=[self.rows, self.hidden])
