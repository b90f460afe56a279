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
sampling.logit_bias         at most ``MAX_LOGIT_BIAS`` (token id, bias) pairs: ids integers
                            >= 0, each once (the vocabulary bounds them, checked by the
                            verifier and the orchestrator), biases finite, in [-100, 100]
sampling.constraint         unset, or a ``Constraint`` (``specdec.request.constraints``):
                            kind one of ``CONSTRAINT_KINDS``, value at most
                            ``MAX_CONSTRAINT_CHARS`` characters, compiling within
                            llguidance's parser limits
tree.method                 one of ``METHODS`` or "lookahead"; a request may also say "vanilla"
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
prompt_logprobs             unset (off) or an integer in [0, ``MAX_LOGPROBS``]: every
                            prompt token's logprob after the first (the verifier's prefill)
prompt_only                 no token generated (max_new_tokens must be 0, n 1): the
                            prompt alone, scored with prompt_logprobs
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

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache

# the field checks, re-exported: the services and the wire check their own fields with them
from specdec.request.checks import (MAX_ID_CHARS, MAX_SHOWN_CHARS, MAX_STOP_CHARS, MAX_STOP_STRINGS,  # noqa: F401
                                    check_cache_salt, check_choice, check_count, check_max_new_tokens, check_owner,
                                    check_real,
                                    check_request_id, check_session_id, check_stop_strings, check_text,
                                    check_token_ids, is_int, is_request_id, prefixed, shown)
from specdec.request.constraints import Constraint
from specdec.request.errors import InvalidArgument
from specdec.request.knobs import (DEFAULT_DEPTH, DEFAULT_EXPAND_K, DEFAULT_METHOD, DEFAULT_PROPOSALS,
                                   DEFAULT_TOTAL_TOKENS)
from specdec.request.tree_shapes import Shape, check_shape

# The tree methods a drafter implements (specdec.tree.build). A request may also ask
# for VANILLA: no drafting, every cycle verifies the root alone; or for LOOKAHEAD:
# lookahead decoding, the verifier drafts each tree from the target itself
# (specdec.tree.lookahead), no drafter involved.
METHODS = ("eagle2", "static", "chain", "no-value", "no-rerank")
VANILLA = "vanilla"
LOOKAHEAD = "lookahead"
TREE_METHODS = METHODS + (LOOKAHEAD,)      # what resolved knobs (TreeParams) may say
REQUEST_METHODS = TREE_METHODS + (VANILLA,)
# How draft tokens are proposed: "top" (the draft's most likely tokens, one-hot
# proposals), "sampled" (drawn from the draft distribution and shipped with the
# tree; sessions at temperature > 0 only), "auto" (sampled when the session
# samples and the drafter has a distribution, else top). See specdec.tree.proposals.
PROPOSALS = ("auto", "top", "sampled")
TREE_KNOBS = ("total_tokens", "depth", "expand_k")

MAX_PROMPT_CHARS = 1 << 20     # 1 Mi characters: far past any context, short of the 64 MiB message cap
MAX_SEED = 2**64 - 1           # the wire's uint64; torch generators take the whole range
# Below this a temperature is refused rather than sampled: logits divided by a
# subnormal temperature overflow to inf and the probabilities become NaN. At
# 1e-6 logits would need a magnitude of 1e32 to overflow; sampling that cold
# is argmax in all but name (use 0).
MIN_TEMPERATURE = 1e-6
MAX_LEASED_SESSIONS = 4096     # session ids one Renew may list (past any backend's session cap)
MAX_PENALTY = 2.0              # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_BIAS = 100.0               # |a logit_bias value| (OpenAI's range)
# logit_bias entries per request. OpenAI documents no limit; this one bounds the
# per-request validation and the bias vector's cost and still lets a client ban
# or favour a thousand tokens.
MAX_LOGIT_BIAS = 1024
MAX_LOGPROBS = 20              # top alternatives per token (OpenAI's top_logprobs limit)
MAX_CHOICES = 16               # n: independent choices per request
MAX_PROMPT_IDS = 1 << 20
MAX_MESSAGES = 1024
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


# A tuple of (token id, bias) pairs is checked once per value: the verifier validates a
# session's params on every verify step. (Equal tuples are equal numbers: 1 and 1.0
# and True share a cache entry, and mean the same id or bias.)
@lru_cache(maxsize=64)
def check_logit_bias(bias, field: str = "logit_bias") -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs: at most ``MAX_LOGIT_BIAS``, ids integers >= 0, each once,
    biases finite in [-``MAX_BIAS``, ``MAX_BIAS``]. The vocabulary bounds the ids
    (``check_token_ids``, where it is known)."""
    if not isinstance(bias, tuple):
        raise InvalidArgument(f"{field} must map token ids to biases, got {type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidArgument(f"{field}: at most {MAX_LOGIT_BIAS} token ids, got {len(bias)}")
    seen = set()
    for entry in bias:
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise InvalidArgument(f"{field} must map token ids to biases, got the entry {shown(entry)}")
        token, value = entry
        if not is_int(token) or token < 0:
            raise InvalidArgument(f"{field}: token id {shown(token)} must be an integer >= 0")
        if token in seen:
            raise InvalidArgument(f"{field}: token id {token} is given twice")
        seen.add(token)
        check_real(value, f"{field}[{token}]", -MAX_BIAS, MAX_BIAS)
    return bias


def logit_bias_pairs(bias) -> tuple:
    """A logit bias as a client may write it (a mapping or pairs) as a tuple of
    pairs, sorted by token id when the ids are integers (one form per bias)."""
    if isinstance(bias, Mapping):
        bias = tuple(bias.items())
    elif isinstance(bias, (list, tuple)):
        bias = tuple(tuple(e) if isinstance(e, (list, tuple)) else e for e in bias)
    else:
        return bias
    if all(isinstance(e, tuple) and len(e) == 2 and is_int(e[0]) for e in bias):
        bias = tuple(sorted(bias, key=lambda e: e[0]))
    return bias


# -- sampling ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 => greedy (argmax)
    top_k: int = 0  # 0 => off; else keep the k most likely tokens
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 => off
    seed: int | None = None  # None => a random seed per request
    # Processors, applied in this order by ``specdec.tree.sampling.target_probs``:
    # grammar mask (``constraint``), logit bias, repetition penalty, frequency and presence penalties,
    # temperature, top-k, top-p, min-p. Greedy decoding takes the argmax of the
    # biased, penalised logits.
    min_p: float = 0.0  # keep tokens with p >= min_p * max p; 0 => off
    presence_penalty: float = 0.0  # minus this once per token generated at least once
    frequency_penalty: float = 0.0  # minus this times the token's count among generated tokens
    repetition_penalty: float = 1.0  # logits of tokens in prompt or output: /p if > 0 else *p; 1 => off
    # (token id, bias) pairs added to the logits (OpenAI's logit_bias); a mapping
    # is taken too and kept as pairs sorted by token id. () => off
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Structured output: only tokens this grammar allows, masked at every tree
    # node along the node's own path (``specdec.tree.grammar``). None => off
    constraint: Constraint | None = None

    def __post_init__(self):
        object.__setattr__(self, "logit_bias", logit_bias_pairs(self.logit_bias))

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
        try:
            check_logit_bias(self.logit_bias, prefixed(field, "logit_bias"))
        except TypeError:               # unhashable entries: not pairs of numbers
            raise InvalidArgument(f"{prefixed(field, 'logit_bias')} must map token ids to biases") from None
        if self.constraint is not None:
            if not isinstance(self.constraint, Constraint):
                raise InvalidArgument(f"{prefixed(field, 'constraint')} must be a Constraint, got "
                                      f"{type(self.constraint).__name__}")
            self.constraint.validate(prefixed(field, "constraint"))
        return self

    def check_vocabulary(self, vocab_size: int, field: str = "") -> SamplingParams:
        """Raise InvalidArgument naming ``field``.logit_bias unless every biased
        token id is inside a vocabulary of ``vocab_size`` (the verifier's check)."""
        check_token_ids((t for t, _ in self.logit_bias), vocab_size, prefixed(field, "logit_bias"))
        return self

    @property
    def penalized(self) -> bool:
        """Whether the target distribution depends on the tokens so far (any penalty on)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def without_penalties(self) -> SamplingParams:
        """These params with every penalty off (the history-free processors
        only: the logit bias and the constraint stay)."""
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
        check_choice(self.method, TREE_METHODS, "method")
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


def check_logprobs(value, field: str = "logprobs") -> int | None:
    """Unset (None) or the top alternatives per token, an integer in [0, ``MAX_LOGPROBS``]."""
    if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
        raise InvalidArgument(f"{field} must be an integer in [0, {MAX_LOGPROBS}] or unset, got {shown(value)}")
    return value


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
    filtering (as vLLM returns by default), for every generated token;
    ``prompt_logprobs`` likewise for every prompt token but the first (each
    given the tokens before it), from the verifier's prefill forward.
    ``prompt_only``: nothing is generated (the prompt alone, scored)."""

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
    prompt_logprobs: int | None = None         # None = off; else top alternatives per prompt token
    prompt_only: bool = False                  # generate nothing: max_new_tokens 0, n 1
    cache_salt: str = ""                       # prefix-cache isolation within a tenant (``backend_salt``)

    def __post_init__(self):
        given = [name for name in ("prompt", "prompt_ids", "messages") if getattr(self, name)]
        if len(given) > 1:
            raise InvalidArgument(f"give one of prompt, prompt_ids, messages; got {' and '.join(given)}")
        if not given:
            raise InvalidArgument("prompt must not be empty (or give prompt_ids or messages)")
        check_text(self.prompt, "prompt", MAX_PROMPT_CHARS, empty_ok=True)
        check_cache_salt(self.cache_salt)
        object.__setattr__(self, "prompt_ids", check_prompt_ids(self.prompt_ids))
        object.__setattr__(self, "messages", check_messages(self.messages))
        for name in ("logprobs", "prompt_logprobs"):
            check_logprobs(getattr(self, name), name)
        if not is_int(self.n) or not 1 <= self.n <= MAX_CHOICES:
            raise InvalidArgument(f"n must be an integer in [1, {MAX_CHOICES}], got {self.n!r}")
        check_count(self.max_new_tokens, "max_new_tokens", note="0 = server default")
        if not isinstance(self.prompt_only, bool):
            raise InvalidArgument(f"prompt_only must be a boolean, got {shown(self.prompt_only)}")
        if self.prompt_only and self.max_new_tokens:
            raise InvalidArgument(f"max_new_tokens must be 0 with prompt_only, got {self.max_new_tokens}")
        if self.prompt_only and self.n != 1:
            raise InvalidArgument(f"n must be 1 with prompt_only (nothing is generated), got {self.n}")
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


def backend_salt(tenant_token: str | None, cache_salt: str = "") -> str:
    """The salt the backends' prefix caches key a request's blocks under
    (``specdec.model.prefix_cache``): a digest of the caller's bearer token
    (its tenant; None or "" for an unauthenticated caller) and the request's
    ``cache_salt``, so neither travels nor is kept in the clear. "" for neither:
    the shared space of unauthenticated, unsalted requests."""
    if not tenant_token and not cache_salt:
        return ""
    h = hashlib.blake2b(digest_size=16, person=b"specdec-tenant")
    for part in (tenant_token or "", cache_salt):
        h.update(len(part.encode()).to_bytes(8, "little"))
        h.update(part.encode())
    return h.hexdigest()
