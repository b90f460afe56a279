"""Python client of the specdec orchestrator (no torch needed); see ``specdec.client.sdk``."""

from specdec.client.sdk import (
    AsyncGenerationStream,
    AsyncSpecdecClient,
    Choice,
    Chunk,
    Completion,
    GenerationStats,
    GenerationStream,
    SpecdecCancelled,
    SpecdecClient,
    SpecdecClientError,
    SpecdecDeadlineExceeded,
    SpecdecInvalidArgument,
    SpecdecNotFound,
    SpecdecResourceExhausted,
    SpecdecUnauthenticated,
    SpecdecUnavailable,
    TokenLogprob,
)

__all__ = [
    "AsyncGenerationStream", "AsyncSpecdecClient", "Choice", "Chunk", "Completion", "GenerationStats", "GenerationStream",
    "SpecdecCancelled", "SpecdecClient", "SpecdecClientError", "SpecdecDeadlineExceeded", "SpecdecInvalidArgument",
    "SpecdecNotFound", "SpecdecResourceExhausted", "SpecdecUnauthenticated", "SpecdecUnavailable",
    "TokenLogprob",
]
