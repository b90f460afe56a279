"""The target's feature rows a session's drafter was sent, kept without torch.

An EAGLE drafter needs the target's feature row before every committed token
but the first; the verifier sends each of them once (prefill: one per prompt
token, each cycle: one per committed token), as ``Tensor`` messages. The
orchestrator keeps those messages and concatenates their raw bytes: same
dtype, row-major [n, H] each, so the bytes of [n1, H] then [n2, H] are those
of [n1 + n2, H].
"""

from __future__ import annotations

from specdec.v1 import common_pb2
from specdec.wire import TENSOR_DTYPES


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
