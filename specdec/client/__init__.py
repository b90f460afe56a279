"""Python client of the specdec orchestrator (no torch needed); see ``specdec.client.sdk``.

May import: gRPC, ``specdec.request``, ``specdec.v1``. Never torch, nor the
serving infrastructure (import-linter's ``torch-free`` and ``layers`` contracts).
"""

from specdec.client.sdk import (AsyncGenerationStream, AsyncSpecdecClient, Choice, Chunk, Completion, GenerationStats,
                                GenerationStream, SpecdecCancelled, SpecdecClient, SpecdecClientError,
                                SpecdecDeadlineExceeded, SpecdecInvalidArgument, SpecdecNotFound,
                                SpecdecResourceExhausted, SpecdecUnauthenticated, SpecdecUnavailable, TokenLogprob)

__all__ = [
    "AsyncGenerationStream", "AsyncSpecdecClient", "Choice", "Chunk", "Completion", "GenerationStats", "GenerationStream",
    "SpecdecCancelled", "SpecdecClient", "SpecdecClientError", "SpecdecDeadlineExceeded", "SpecdecInvalidArgument",
    "SpecdecNotFound", "SpecdecResourceExhausted", "SpecdecUnauthenticated", "SpecdecUnavailable",
    "TokenLogprob",
]
