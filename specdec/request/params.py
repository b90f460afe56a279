"""Request parameters, torch-free: what a client may ask for, its bounds, its validation.

Every component (CLI, SDK, wire conversion, services, engines) uses these
frozen dataclasses and this one list of methods; protos are converted to and
from them only at the edges (``specdec.request.wire``). A value out of bounds raises
``specdec.request.errors.InvalidArgument`` whose message starts with the field as a
client writes it (``sampling.top_p must be in (0, 1], got 1.5``).

Bounds, field by field (a request's 0 / "" / unset leaves a knob to the server):

==========================  ====================================================
sampling.temperature        0 (greedy) or finite and >= ``MIN_TEMPERATURE``
sampling.top_k              integer >= 0 (0 = off)
sampling.top_p              in (0, 1] (on the wire 0 = unset = 1)
sampling.seed               integer in [0, 2**64), or unset (the server draws one)
sampling.min_p              in [0, 1] (0 = off; on the wire 0 = unset)
sampling.presence_penalty   finite, in [-2, 2] (0 = off; OpenAI semantics: generated tokens only)
sampling.frequency_penalty  finite, in [-2, 2] (0 = off; OpenAI semantics: generated tokens only)
sampling.repetition_penalty finite, > 0 (1 = off; on the wire 0 = unset = 1; prompt and
                            generated tokens, as transformers and vLLM apply it)
tree.method                 one of ``METHODS``; a request may also say "vanilla"
tree.total_tokens, depth,   integer >= 1 (a request: >= 0, 0 = server default;
tree.expand_k               larger values are clamped to the drafter's limits)
tree.value_temperature      finite, >= ``MIN_TEMPERATURE`` (a request: also 0 = the
                            drafter's choice)
tree.proposals              one of ``PROPOSALS``
tree.static_shape           rank paths, each after its parent (``tree_shapes``)
prompt                      1 to ``MAX_PROMPT_CHARS`` characters (the model's
                            context bounds its tokens, checked by the server);
                            exactly one of prompt, prompt_ids, messages is given
prompt_ids                  1 to ``MAX_PROMPT_IDS`` token ids, each >= 0 (the
                            vocabulary bounds them, checked by the verifier)
messages                    1 to ``MAX_MESSAGES`` chat messages: role one of
                            ``CHAT_ROLES``, content at most ``MAX_PROMPT_CHARS``
                            characters (rendered with the model's chat template)
logprobs                    unset (off) or an integer in [0, ``MAX_LOGPROBS``]: the
                            chosen token's logprob plus that many top alternatives
n                           integer in [1, ``MAX_CHOICES``] (on the wire 0 = 1)
max_new_tokens              integer >= 0 (0 = server default; the server's limit)
stop                        at most ``MAX_STOP_STRINGS`` strings of 1 to
                            ``MAX_STOP_CHARS`` characters
request_id                  at most ``MAX_ID_CHARS`` printable ASCII characters
                            (it travels as gRPC metadata)
session_id (internal)       1 to ``MAX_ID_CHARS`` characters
owner (internal)            at most ``MAX_ID_CHARS`` characters ("" = no lease)
session_ids (Renew)         at most ``MAX_LEASED_SESSIONS`` session ids
counts (internal)           integers >= 0 (rollback lengths, DraftAhead count...)
token ids (internal)        in [0, vocabulary size): prompt_ids, token_ids,
                            commit_tokens (a Prefill needs at least one; an
                            EAGLE drafter's, two)
==========================  ====================================================

An error message never echoes more than ``MAX_SHOWN_CHARS`` of a client's
value (``shown``): status details travel in size-limited metadata.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from specdec.request.errors import InvalidArgument
from specdec.request.knobs import (DEFAULT_DEPTH, DEFAULT_EXPAND_K, DEFAULT_METHOD, DEFAULT_PROPOSALS,
                                   DEFAULT_TOTAL_TOKENS)
from specdec.request.tree_shapes import Shape, check_shape

# The tree methods a drafter implements (specdec.tree.build). A request may also ask
# for VANILLA: no drafting, every cycle verifies the root alone.
METHODS = ("eagle2", "static", "chain", "no-value", "no-rerank")
VANILLA = "vanilla"
REQUEST_METHODS = METHODS + (VANILLA,)
# How draft tokens are proposed: "top" (the draft's most likely tokens, one-hot
# proposals), "sampled" (drawn from the draft distribution and shipped with the
# tree; sessions at temperature > 0 only), "auto" (sampled when the session
# samples and the drafter has a distribution, else top). See specdec.tree.proposals.
PROPOSALS = ("auto", "top", "sampled")
TREE_KNOBS = ("total_tokens", "depth", "expand_k")

MAX_PROMPT_CHARS = 1 << 20     # 1 Mi characters: far past any context, short of the 64 MiB message cap
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_ID_CHARS = 128             # request and session ids (they travel in metadata and logs)
MAX_SEED = 2**64 - 1           # the wire's uint64; torch generators take the whole range
# Below this a temperature is refused rather than sampled: logits divided by a
# subnormal temperature overflow to inf and the probabilities become NaN. At
# 1e-6 logits would need a magnitude of 1e32 to overflow; sampling that cold
# is argmax in all but name (use 0).
MIN_TEMPERATURE = 1e-6
MAX_SHOWN_CHARS = 64           # of a client's value echoed in an error message
MAX_LEASED_SESSIONS = 4096     # session ids one Renew may list (past any backend's session cap)
MAX_PENALTY = 2.0              # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_LOGPROBS = 20              # top alternatives per token (OpenAI's top_logprobs limit)
MAX_CHOICES = 16               # n: independent choices per request
MAX_PROMPT_IDS = 1 << 20
MAX_MESSAGES = 1024
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


# -- field checks ------------------------------------------------------------------------------
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


# -- sampling ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 => greedy (argmax)
    top_k: int = 0  # 0 => off; else keep the k most likely tokens
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 => off
    seed: int | None = None  # None => a random seed per request
    # Processors, applied in this order by ``specdec.tree.sampling.target_probs``:
    # repetition penalty, frequency and presence penalties, temperature, top-k,
    # top-p, min-p. Greedy decoding takes the argmax of the penalised logits.
    min_p: float = 0.0  # keep tokens with p >= min_p * max p; 0 => off
    presence_penalty: float = 0.0  # minus this once per token generated at least once
    frequency_penalty: float = 0.0  # minus this times the token's count among generated tokens
    repetition_penalty: float = 1.0  # logits of tokens in prompt or output: /p if > 0 else *p; 1 => off

    def validate(self, field: str = "") -> SamplingParams:
        """Raise InvalidArgument naming ``field``.<name> unless every value is in bounds."""
        # Written as negated range checks so that NaN fails them too.
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (t == 0 or MIN_TEMPERATURE <= t < math.inf):
            raise InvalidArgument(f"{prefixed(field, 'temperature')} must be >= 0 and finite (0 = greedy, else "
                                  f">= {MIN_TEMPERATURE:g}), got {t!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument(f"{prefixed(field, 'top_p')} must be in (0, 1], got {self.top_p!r}")
        check_count(self.top_k, prefixed(field, "top_k"), note="0 = off")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise InvalidArgument(f"{prefixed(field, 'seed')} must be an integer in [0, 2**64), got {self.seed!r}")
        check_real(self.min_p, prefixed(field, "min_p"), 0.0, 1.0)
        for name in ("presence_penalty", "frequency_penalty"):
            check_real(getattr(self, name), prefixed(field, name), -MAX_PENALTY, MAX_PENALTY)
        check_real(self.repetition_penalty, prefixed(field, "repetition_penalty"), 0.0, low_open=True)
        return self

    @property
    def penalized(self) -> bool:
        """Whether the target distribution depends on the tokens so far (any penalty on)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def without_penalties(self) -> SamplingParams:
        """These params with every penalty off (the history-free processors only)."""
        return replace(self, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# -- tree knobs --------------------------------------------------------------------------------
def check_value_temperature(t, field: str, zero_ok: bool = False) -> None:
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not (
            MIN_TEMPERATURE <= t < math.inf or (t == 0 and zero_ok)):
        bound = f">= 0 (0 = the drafter's choice, else >= {MIN_TEMPERATURE:g})" if zero_ok else f">= {MIN_TEMPERATURE:g}"
        raise InvalidArgument(f"{field} must be {bound} and finite, got {t!r}")


@dataclass(frozen=True)
class TreeParams:
    """Resolved tree knobs, as a drafter builds a tree with them (every knob set)."""

    method: str = DEFAULT_METHOD
    total_tokens: int = DEFAULT_TOTAL_TOKENS  # nodes in the draft incl. the root
    depth: int = DEFAULT_DEPTH  # deepest draft level (root is level 0); at most this many expand() calls
    expand_k: int = DEFAULT_EXPAND_K  # children per expanded node and frontier width
    static_shape: Shape | None = None  # "static": rank paths, e.g. ((0,), (1,), (0, 0)); None = default
    # Draft logits are divided by this before the log-probs that make node values
    # (rank and rerank); None: the drafter's choice (its calibration for greedy
    # sessions, else 1). Output never depends on it.
    value_temperature: float | None = None
    proposals: str = DEFAULT_PROPOSALS  # one of PROPOSALS; the drafter resolves "auto"

    def __post_init__(self):
        check_choice(self.method, METHODS, "method")
        check_choice(self.proposals, PROPOSALS, "proposals")
        for name in TREE_KNOBS:
            check_count(getattr(self, name), name, low=1)
        if self.static_shape is not None:
            try:
                shape = tuple(tuple(path) for path in self.static_shape)
            except TypeError as e:
                raise InvalidArgument(f"static_shape must be a sequence of rank paths: {e}") from None
            try:
                check_shape(shape)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
            object.__setattr__(self, "static_shape", shape)
        if self.value_temperature is not None:
            check_value_temperature(self.value_temperature, "value_temperature")

    def clamped(self, limits: TreeParams) -> TreeParams:
        """These knobs, each at most the one of ``limits`` (method and the rest unchanged)."""
        return replace(self, **{k: min(getattr(self, k), getattr(limits, k)) for k in TREE_KNOBS})


@dataclass(frozen=True)
class TreeRequest:
    """A request's tree knobs as a client writes them: "" / 0 / "auto" leave a
    knob to the server, whose defaults fill it in (``resolve``)."""

    method: str = ""               # "" = server default; one of REQUEST_METHODS
    total_tokens: int = 0          # 0 = server default (all three are clamped to the drafter's limits)
    depth: int = 0
    expand_k: int = 0
    value_temperature: float = 0.0   # 0 = the drafter's choice
    proposals: str = "auto"          # "auto" = the server's default (itself "auto" unless configured)

    def __post_init__(self):
        if self.method:
            check_choice(self.method, REQUEST_METHODS, "tree.method")
        for name in TREE_KNOBS:
            check_count(getattr(self, name), f"tree.{name}", note="0 = server default")
        check_value_temperature(self.value_temperature, "tree.value_temperature", zero_ok=True)
        check_choice(self.proposals, PROPOSALS, "tree.proposals")

    @property
    def vanilla(self) -> bool:
        return self.method == VANILLA

    def resolve(self, default: TreeParams, limits: TreeParams | None = None) -> TreeParams | None:
        """The knobs a drafter builds with: unset ones from ``default``, all
        clamped to ``limits`` when given; None for VANILLA (no drafting)."""
        if self.vanilla:
            return None
        method = self.method or default.method
        knobs = {name: getattr(self, name) or getattr(default, name) for name in TREE_KNOBS}
        resolved = replace(default, method=method, static_shape=default.static_shape if method == default.method
                           else None, value_temperature=self.value_temperature or default.value_temperature,
                           proposals=default.proposals if self.proposals == "auto" else self.proposals, **knobs)
        return resolved if limits is None else resolved.clamped(limits)


# -- a whole request ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


def check_messages(messages, field: str = "messages") -> tuple[ChatMessage, ...]:
    messages = tuple(messages)
    if len(messages) > MAX_MESSAGES:
        raise InvalidArgument(f"{field}: at most {MAX_MESSAGES} messages, got {len(messages)}")
    for i, m in enumerate(messages):
        check_choice(m.role, CHAT_ROLES, f"{field}[{i}].role")
        check_text(m.content, f"{field}[{i}].content", MAX_PROMPT_CHARS, empty_ok=True)
    return messages


def check_prompt_ids(ids, field: str = "prompt_ids") -> tuple[int, ...]:
    ids = tuple(ids)
    if len(ids) > MAX_PROMPT_IDS:
        raise InvalidArgument(f"{field}: at most {MAX_PROMPT_IDS} token ids, got {len(ids)}")
    bad = next((i for i, t in enumerate(ids) if not is_int(t) or t < 0), None)
    if bad is not None:
        raise InvalidArgument(f"{field}[{bad}] must be a token id >= 0, got {ids[bad]!r}")
    return ids


@dataclass(frozen=True)
class GenerationRequest:
    """A validated public request (``GenerateRequest`` / ``CompleteRequest``):
    constructing one checks every field. Server-dependent bounds (the
    max_new_tokens limit, the model's context, the vocabulary) are the
    server's to check.

    The prompt is exactly one of ``prompt`` (text), ``prompt_ids`` (token ids,
    used as they are) or ``messages`` (a chat, rendered with the model's chat
    template by the server). ``logprobs`` come from the raw model: the
    log-softmax of the target's logits, before penalties, temperature and
    filtering (as vLLM returns by default), for every generated token."""

    prompt: str = ""
    max_new_tokens: int = 0                    # 0 = server default
    sampling: SamplingParams = SamplingParams()
    tree: TreeRequest = TreeRequest()
    stop: tuple[str, ...] = ()                 # stop strings (not included in the output)
    request_id: str = ""                       # optional; echoed in logs and stats
    prompt_ids: tuple[int, ...] = ()
    messages: tuple[ChatMessage, ...] = ()
    logprobs: int | None = None                # None = off; else top alternatives per token
    n: int = 1                                 # independent choices; choice i > 0 reseeded (``choice_seed``)

    def __post_init__(self):
        given = [name for name in ("prompt", "prompt_ids", "messages") if getattr(self, name)]
        if len(given) > 1:
            raise InvalidArgument(f"give one of prompt, prompt_ids, messages; got {' and '.join(given)}")
        if not given:
            raise InvalidArgument("prompt must not be empty (or give prompt_ids or messages)")
        check_text(self.prompt, "prompt", MAX_PROMPT_CHARS, empty_ok=True)
        object.__setattr__(self, "prompt_ids", check_prompt_ids(self.prompt_ids))
        object.__setattr__(self, "messages", check_messages(self.messages))
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidArgument(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or unset, got {self.logprobs!r}")
        if not is_int(self.n) or not 1 <= self.n <= MAX_CHOICES:
            raise InvalidArgument(f"n must be an integer in [1, {MAX_CHOICES}], got {self.n!r}")
        check_count(self.max_new_tokens, "max_new_tokens", note="0 = server default")
        self.sampling.validate("sampling")
        object.__setattr__(self, "stop", check_stop_strings(self.stop))
        check_request_id(self.request_id)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's logprob under the raw model (log-softmax of the
    target's logits, before any sampling processor) and the most likely
    alternatives at its position, most likely first."""

    token: int
    logprob: float
    top_tokens: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded with ``seed``: the seed
    itself for choice 0 (n = 1 reproduces a plain request), else a splitmix64
    mix of the two, so every choice is independent and a seed reproduces all."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & MAX_SEED
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MAX_SEED
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MAX_SEED
    return (z ^ (z >> 31)) >> 1
