"""Request parameters, torch-free: what a client may ask for and its limits.

Every component (CLI, SDK, wire conversion, services, engines) uses these
frozen dataclasses; protos are converted to and from them only at the edges
(``specdec.wire``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdec.knobs import (DEFAULT_DEPTH, DEFAULT_EXPAND_K, DEFAULT_METHOD, DEFAULT_PROPOSALS,
                           DEFAULT_TOTAL_TOKENS, METHODS, PROPOSALS)
from specdec.tree_shapes import Shape, check_shape


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 => greedy (argmax)
    top_k: int = 0  # 0 => off; else keep the k most likely tokens
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 => off
    seed: int | None = None  # None => a random seed per request

    def validate(self) -> None:
        # Written as negated range checks so that NaN fails them too.
        if not (self.temperature >= 0.0) or math.isinf(self.temperature):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class TreeParams:
    method: str = DEFAULT_METHOD
    total_tokens: int = DEFAULT_TOTAL_TOKENS  # nodes in the draft incl. the root
    depth: int = DEFAULT_DEPTH  # deepest draft level (root is level 0); at most this many expand() calls
    expand_k: int = DEFAULT_EXPAND_K  # children per expanded node and frontier width
    static_shape: Shape | None = None  # "static": rank paths, e.g. ((0,), (1,), (0, 0)); None = default
    # Draft logits are divided by this before the log-probs that make node values
    # (rank and rerank); None: the drafter's choice (its calibration for greedy
    # sessions, else 1). Output never depends on it.
    value_temperature: float | None = None
    proposals: str = DEFAULT_PROPOSALS  # "auto" | "top" | "sampled" (knobs.PROPOSALS); the drafter resolves it


    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.proposals not in PROPOSALS:
            raise ValueError(f"proposals must be one of {PROPOSALS}, got {self.proposals!r}")
        for name in ("total_tokens", "depth", "expand_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.static_shape is not None:
            try:
                shape = tuple(tuple(path) for path in self.static_shape)
            except TypeError as e:
                raise ValueError(f"static_shape must be a sequence of rank paths: {e}") from None
            check_shape(shape)
            object.__setattr__(self, "static_shape", shape)
        t = self.value_temperature
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf):
            raise ValueError(f"value_temperature must be a number > 0, got {t!r}")
