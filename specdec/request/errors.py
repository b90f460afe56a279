"""Errors that carry the status a client should see.

Engines raise these; services translate ``code`` to a gRPC status and the CLI
turns them into one line on stderr and a non-zero exit.
"""

from __future__ import annotations


class SpecdecError(Exception):
    code = "INTERNAL"


class InvalidArgument(SpecdecError, ValueError):
    code = "INVALID_ARGUMENT"


class NotFound(SpecdecError, KeyError):
    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "not found"


class ResourceExhausted(SpecdecError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(SpecdecError):
    code = "UNAVAILABLE"


class FailedPrecondition(SpecdecError):
    code = "FAILED_PRECONDITION"


class UsageError(Exception):
    """A failure the user can fix (a bad flag or input file, a service that
    would not start, a failed request of a command): the CLI prints it as one
    line on stderr and exits with status 2."""
