"""Checks of single request fields, shared by every parameter type
(``specdec.request.params``) and the services' own messages: each returns the
value it accepts or raises ``InvalidArgument`` naming the field, and never
echoes more than ``MAX_SHOWN_CHARS`` of a client's value (status details travel
in size-limited metadata).
"""

from __future__ import annotations

import math

from specdec.request.errors import InvalidArgument

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_ID_CHARS = 128             # request and session ids (they travel in metadata and logs)
MAX_SHOWN_CHARS = 64           # of a client's value echoed in an error message
MAX_SALT_CHARS = 256           # a request's cache_salt, and the salt the backends key prefix blocks under


def shown(value) -> str:
    """``repr(value)``, cut to ``MAX_SHOWN_CHARS`` characters for an error message."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else f"{text[:MAX_SHOWN_CHARS]}... ({len(text)} characters)"


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_count(value, field: str, low: int = 0, note: str = "") -> int:
    """An integer >= ``low``; ``note`` says what a special value means (e.g. "0 = server default")."""
    if not is_int(value) or value < low:
        bound = f">= {low} ({note})" if note and is_int(value) else f"an integer >= {low}"
        raise InvalidArgument(f"{field} must be {bound}, got {shown(value)}")
    return value


def check_max_new_tokens(value: int, limit: int) -> int:
    """A request's max_new_tokens (already >= 0) within a server's limit."""
    if value > limit:
        raise InvalidArgument(f"max_new_tokens must be <= {limit}, got {value}")
    return value


def check_text(value, field: str, max_chars: int, *, empty_ok: bool = False, ascii_only: bool = False) -> str:
    """A string of at most ``max_chars`` characters (non-empty unless ``empty_ok``)."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{field} must be a string, got {type(value).__name__}")
    if not value and not empty_ok:
        raise InvalidArgument(f"{field} must not be empty")
    if len(value) > max_chars:
        raise InvalidArgument(f"{field} must be at most {max_chars} characters, got {len(value)}")
    if ascii_only and not all(" " <= c <= "~" for c in value):
        raise InvalidArgument(f"{field} must be printable ASCII")
    return value


def check_session_id(value, field: str = "session_id") -> str:
    return check_text(value, field, MAX_ID_CHARS)


def check_owner(value, field: str = "owner") -> str:
    return check_text(value, field, MAX_ID_CHARS, empty_ok=True)


def check_cache_salt(value, field: str = "cache_salt") -> str:
    return check_text(value, field, MAX_SALT_CHARS, empty_ok=True)


def check_request_id(value, field: str = "request_id") -> str:
    return check_text(value, field, MAX_ID_CHARS, empty_ok=True, ascii_only=True)


def is_request_id(value) -> bool:
    """Whether ``value`` would pass ``check_request_id`` and is not empty (metadata checks)."""
    try:
        return bool(check_request_id(value))
    except InvalidArgument:
        return False


def check_token_ids(tokens, vocab_size: int, field: str, min_count: int = 0,
                    vocabulary: str = "vocabulary") -> list[int]:
    """Token ids in [0, ``vocab_size``), at least ``min_count`` of them;
    ``vocabulary`` names the vocabulary in the message."""
    tokens = list(tokens)
    if not tokens and min_count:
        raise InvalidArgument(f"{field} must not be empty")
    if len(tokens) < min_count:
        raise InvalidArgument(f"{field} must hold at least {min_count} token ids, got {len(tokens)}")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"{field}: token id {bad} is outside the {vocabulary} [0, {vocab_size})")
    return tokens


def check_stop_strings(stop, field: str = "stop") -> tuple[str, ...]:
    stop = tuple(stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"{field}: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for i, s in enumerate(stop):
        check_text(s, f"{field}[{i}]", MAX_STOP_CHARS)
    return stop


def check_real(value, field: str, low: float, high: float = math.inf, *, low_open: bool = False) -> float:
    """A finite number in [low, high] ((low, ...] when ``low_open``); NaN and infinities fail."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok:
        ok = (low < value if low_open else low <= value) and value <= high
    if not ok:
        if math.isinf(high):
            bound = f"{'>' if low_open else '>='} {low:g} and finite"
        else:
            bound = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
        raise InvalidArgument(f"{field} must be {bound}, got {value!r}")
    return value


def check_choice(value, choices: tuple[str, ...], field: str) -> str:
    if value not in choices:
        raise InvalidArgument(f"{field} must be one of {', '.join(choices)}, got {shown(value)}")
    return value


def prefixed(field: str, name: str) -> str:
    return f"{field}.{name}" if field else name
