"""What the SDK returns: stream chunks, per-request stats, choices and completions.

Torch-free, like the rest of the SDK; ``specdec.client.sdk`` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from specdec.request.params import TokenLogprob
from specdec.request.wire import logprobs_from_proto
from specdec.v1 import orchestrator_pb2


@dataclass(frozen=True)
class Chunk:
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)   # one per token id, when asked for
    index: int = 0                                               # the choice (requests with n > 1)


@dataclass(frozen=True)
class GenerationStats:
    """Per-request figures: tau counts the bonus token (tokens per cycle);
    the time split draft_s + verify_s + network_s + other_s = wall_s."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cycles: int = 0
    tau: float = 0.0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    network_s: float = 0.0
    other_s: float = 0.0
    ttft_s: float = 0.0
    wall_s: float = 0.0
    finish_reason: str = ""
    request_id: str = ""
    ahead_hits: int = 0                  # cycles whose tree was drafted one round ahead
    index: int = 0                       # the choice these stats are of (n > 1)
    wire_bytes: int = 0                  # serialized bytes of the orchestrator's backend calls
    ahead_draft_s: float = 0.0           # drafter compute spent drafting one round ahead
    ahead_committed: int = 0             # tokens committed by the cycles whose tree was drafted ahead

    @classmethod
    def from_proto(cls, msg: orchestrator_pb2.GenerationStats) -> GenerationStats:
        values = {f.name: getattr(msg, f.name) for f in fields(cls)}
        values["accepted_per_position"] = list(msg.accepted_per_position)
        return cls(**values)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class Choice:
    """One of a request's n choices (streams fill it in as chunks arrive)."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)   # raw-model logprobs, when asked for
    stats: GenerationStats | None = None

    @classmethod
    def from_proto(cls, msg: orchestrator_pb2.Choice) -> Choice:
        return cls(msg.index, msg.text, list(msg.token_ids), logprobs_from_proto(msg.logprobs),
                   GenerationStats.from_proto(msg.stats))


@dataclass(frozen=True)
class Completion:
    """Choice 0's text, tokens, stats and logprobs; ``choices``: all of them;
    with ``prompt_logprobs`` asked for, the prompt's token ids and the
    logprobs of all of them but the first."""

    text: str
    token_ids: list[int]
    stats: GenerationStats
    logprobs: list[TokenLogprob] = field(default_factory=list)
    choices: list[Choice] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    @classmethod
    def from_proto(cls, resp: orchestrator_pb2.CompleteResponse) -> Completion:
        return cls(resp.text, list(resp.token_ids), GenerationStats.from_proto(resp.stats),
                   logprobs_from_proto(resp.logprobs), [Choice.from_proto(c) for c in resp.choices],
                   list(resp.prompt_ids), logprobs_from_proto(resp.prompt_logprobs))
