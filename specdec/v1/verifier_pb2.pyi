from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifierPrefillRequest(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "sampling", "max_new_tokens", "return_features", "resume", "owner", "logprobs", "prompt_tokens", "feature_layers", "prompt_logprobs", "cache_salt")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    max_new_tokens: int
    return_features: bool
    resume: bool
    owner: str
    logprobs: int
    prompt_tokens: int
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: int
    cache_salt: str
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., return_features: _Optional[bool] = ..., resume: _Optional[bool] = ..., owner: _Optional[str] = ..., logprobs: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., feature_layers: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class VerifierPrefillResponse(_message.Message):
    __slots__ = ("token", "features", "compute_s", "logprobs", "prompt_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: int
    features: _common_pb2.Tensor
    compute_s: float
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token: _Optional[int] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., compute_s: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "tree", "return_features", "lookahead_depth")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_DEPTH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tree: _common_pb2.DraftTree
    return_features: bool
    lookahead_depth: int
    def __init__(self, session_id: _Optional[str] = ..., tree: _Optional[_Union[_common_pb2.DraftTree, _Mapping]] = ..., return_features: _Optional[bool] = ..., lookahead_depth: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("accepted_nodes", "tokens", "features", "compute_s", "logprobs", "verified_nodes")
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_NODES_FIELD_NUMBER: _ClassVar[int]
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    features: _common_pb2.Tensor
    compute_s: float
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    verified_nodes: int
    def __init__(self, accepted_nodes: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., compute_s: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., verified_nodes: _Optional[int] = ...) -> None: ...

class VerifierRollbackRequest(_message.Message):
    __slots__ = ("session_id", "length")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    length: int
    def __init__(self, session_id: _Optional[str] = ..., length: _Optional[int] = ...) -> None: ...

class VerifierRollbackResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class VerifierReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class VerifierGetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierGetInfoResponse(_message.Message):
    __slots__ = ("model", "vocab_size", "hidden_size", "max_positions", "active_sessions", "max_sessions", "kv_bytes", "num_layers")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    hidden_size: int
    max_positions: int
    active_sessions: int
    max_sessions: int
    kv_bytes: int
    num_layers: int
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., max_positions: _Optional[int] = ..., active_sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., num_layers: _Optional[int] = ...) -> None: ...

class VerifierRenewRequest(_message.Message):
    __slots__ = ("owner", "session_ids")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    owner: str
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, owner: _Optional[str] = ..., session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class VerifierRenewResponse(_message.Message):
    __slots__ = ("renewed", "lease_s")
    RENEWED_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    renewed: int
    lease_s: float
    def __init__(self, renewed: _Optional[int] = ..., lease_s: _Optional[float] = ...) -> None: ...

class VerifierSessionRequest(_message.Message):
    __slots__ = ("prefill", "verify")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    prefill: VerifierPrefillRequest
    verify: VerifyRequest
    def __init__(self, prefill: _Optional[_Union[VerifierPrefillRequest, _Mapping]] = ..., verify: _Optional[_Union[VerifyRequest, _Mapping]] = ...) -> None: ...

class VerifierSessionResponse(_message.Message):
    __slots__ = ("prefill", "verify")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    prefill: VerifierPrefillResponse
    verify: VerifyResponse
    def __init__(self, prefill: _Optional[_Union[VerifierPrefillResponse, _Mapping]] = ..., verify: _Optional[_Union[VerifyResponse, _Mapping]] = ...) -> None: ...

class RunStart(_message.Message):
    __slots__ = ("prefill", "drafter", "tree", "lookahead", "verify_token_budget", "min_tau", "eos_token_ids", "drafter_cache_salt", "ahead_unbudgeted", "min_tau_prior")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    VERIFY_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MIN_TAU_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    AHEAD_UNBUDGETED_FIELD_NUMBER: _ClassVar[int]
    MIN_TAU_PRIOR_FIELD_NUMBER: _ClassVar[int]
    prefill: VerifierPrefillRequest
    drafter: str
    tree: _common_pb2.TreeParams
    lookahead: int
    verify_token_budget: int
    min_tau: float
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    drafter_cache_salt: str
    ahead_unbudgeted: bool
    min_tau_prior: bool
    def __init__(self, prefill: _Optional[_Union[VerifierPrefillRequest, _Mapping]] = ..., drafter: _Optional[str] = ..., tree: _Optional[_Union[_common_pb2.TreeParams, _Mapping]] = ..., lookahead: _Optional[int] = ..., verify_token_budget: _Optional[int] = ..., min_tau: _Optional[float] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., drafter_cache_salt: _Optional[str] = ..., ahead_unbudgeted: _Optional[bool] = ..., min_tau_prior: _Optional[bool] = ...) -> None: ...

class RunStop(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunPair(_message.Message):
    __slots__ = ("drafter",)
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    drafter: str
    def __init__(self, drafter: _Optional[str] = ...) -> None: ...

class RunRequest(_message.Message):
    __slots__ = ("start", "stop", "pair")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PAIR_FIELD_NUMBER: _ClassVar[int]
    start: RunStart
    stop: RunStop
    pair: RunPair
    def __init__(self, start: _Optional[_Union[RunStart, _Mapping]] = ..., stop: _Optional[_Union[RunStop, _Mapping]] = ..., pair: _Optional[_Union[RunPair, _Mapping]] = ...) -> None: ...

class RunCommit(_message.Message):
    __slots__ = ("tokens", "logprobs", "accepted", "nodes", "ahead", "hops", "draft_s", "verify_s", "prompt_logprobs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    HOPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    accepted: int
    nodes: int
    ahead: bool
    hops: int
    draft_s: float
    verify_s: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., accepted: _Optional[int] = ..., nodes: _Optional[int] = ..., ahead: _Optional[bool] = ..., hops: _Optional[int] = ..., draft_s: _Optional[float] = ..., verify_s: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class RunDone(_message.Message):
    __slots__ = ("finish_reason", "fallback", "drafts", "ahead_hits", "ahead_draft_s", "wire_bytes")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_HITS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    fallback: str
    drafts: int
    ahead_hits: int
    ahead_draft_s: float
    wire_bytes: int
    def __init__(self, finish_reason: _Optional[str] = ..., fallback: _Optional[str] = ..., drafts: _Optional[int] = ..., ahead_hits: _Optional[int] = ..., ahead_draft_s: _Optional[float] = ..., wire_bytes: _Optional[int] = ...) -> None: ...

class RunDrafterLost(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class RunEvent(_message.Message):
    __slots__ = ("commit", "done", "drafter_lost")
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_LOST_FIELD_NUMBER: _ClassVar[int]
    commit: RunCommit
    done: RunDone
    drafter_lost: RunDrafterLost
    def __init__(self, commit: _Optional[_Union[RunCommit, _Mapping]] = ..., done: _Optional[_Union[RunDone, _Mapping]] = ..., drafter_lost: _Optional[_Union[RunDrafterLost, _Mapping]] = ...) -> None: ...
