from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrafterPrefillRequest(_message.Message):
    __slots__ = ("session_id", "token_ids", "features", "greedy", "sampling", "owner", "cache_salt")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    features: _common_pb2.Tensor
    greedy: bool
    sampling: _common_pb2.SamplingParams
    owner: str
    cache_salt: str
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., greedy: _Optional[bool] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., owner: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class DrafterPrefillResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("session_id", "commit_tokens", "commit_features", "tree", "ahead")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    commit_tokens: _containers.RepeatedScalarFieldContainer[int]
    commit_features: _common_pb2.Tensor
    tree: _common_pb2.TreeParams
    ahead: bool
    def __init__(self, session_id: _Optional[str] = ..., commit_tokens: _Optional[_Iterable[int]] = ..., commit_features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., tree: _Optional[_Union[_common_pb2.TreeParams, _Mapping]] = ..., ahead: _Optional[bool] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("tree", "compute_s")
    TREE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    tree: _common_pb2.DraftTree
    compute_s: float
    def __init__(self, tree: _Optional[_Union[_common_pb2.DraftTree, _Mapping]] = ..., compute_s: _Optional[float] = ...) -> None: ...

class DraftAheadRequest(_message.Message):
    __slots__ = ("session_id", "commit_tokens", "commit_features", "tree", "count", "tokens_left", "budget_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_LEFT_FIELD_NUMBER: _ClassVar[int]
    BUDGET_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    commit_tokens: _containers.RepeatedScalarFieldContainer[int]
    commit_features: _common_pb2.Tensor
    tree: _common_pb2.TreeParams
    count: int
    tokens_left: int
    budget_s: float
    def __init__(self, session_id: _Optional[str] = ..., commit_tokens: _Optional[_Iterable[int]] = ..., commit_features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., tree: _Optional[_Union[_common_pb2.TreeParams, _Mapping]] = ..., count: _Optional[int] = ..., tokens_left: _Optional[int] = ..., budget_s: _Optional[float] = ...) -> None: ...

class AheadTree(_message.Message):
    __slots__ = ("commit_tokens", "tree")
    COMMIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    commit_tokens: _containers.RepeatedScalarFieldContainer[int]
    tree: _common_pb2.DraftTree
    def __init__(self, commit_tokens: _Optional[_Iterable[int]] = ..., tree: _Optional[_Union[_common_pb2.DraftTree, _Mapping]] = ...) -> None: ...

class DraftAheadResponse(_message.Message):
    __slots__ = ("trees", "compute_s", "paths")
    TREES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    trees: _containers.RepeatedCompositeFieldContainer[AheadTree]
    compute_s: float
    paths: int
    def __init__(self, trees: _Optional[_Iterable[_Union[AheadTree, _Mapping]]] = ..., compute_s: _Optional[float] = ..., paths: _Optional[int] = ...) -> None: ...

class DrafterCommitRequest(_message.Message):
    __slots__ = ("session_id", "token_ids", "features")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    features: _common_pb2.Tensor
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class DrafterCommitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterRollbackRequest(_message.Message):
    __slots__ = ("session_id", "length")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    length: int
    def __init__(self, session_id: _Optional[str] = ..., length: _Optional[int] = ...) -> None: ...

class DrafterRollbackResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DrafterReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class DrafterGetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterGetInfoResponse(_message.Message):
    __slots__ = ("kind", "needs_features", "vocab_size", "active_sessions", "max_sessions", "max_tree", "drafts_ahead", "feature_layers")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NEEDS_FEATURES_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_AHEAD_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    needs_features: bool
    vocab_size: int
    active_sessions: int
    max_sessions: int
    max_tree: _common_pb2.TreeParams
    drafts_ahead: bool
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[str] = ..., needs_features: _Optional[bool] = ..., vocab_size: _Optional[int] = ..., active_sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_tree: _Optional[_Union[_common_pb2.TreeParams, _Mapping]] = ..., drafts_ahead: _Optional[bool] = ..., feature_layers: _Optional[_Iterable[int]] = ...) -> None: ...

class DrafterRenewRequest(_message.Message):
    __slots__ = ("owner", "session_ids")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    owner: str
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, owner: _Optional[str] = ..., session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DrafterRenewResponse(_message.Message):
    __slots__ = ("renewed", "lease_s")
    RENEWED_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    renewed: int
    lease_s: float
    def __init__(self, renewed: _Optional[int] = ..., lease_s: _Optional[float] = ...) -> None: ...

class DrafterSessionRequest(_message.Message):
    __slots__ = ("prefill", "draft", "draft_ahead")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_FIELD_NUMBER: _ClassVar[int]
    prefill: DrafterPrefillRequest
    draft: DraftRequest
    draft_ahead: DraftAheadRequest
    def __init__(self, prefill: _Optional[_Union[DrafterPrefillRequest, _Mapping]] = ..., draft: _Optional[_Union[DraftRequest, _Mapping]] = ..., draft_ahead: _Optional[_Union[DraftAheadRequest, _Mapping]] = ...) -> None: ...

class DrafterSessionResponse(_message.Message):
    __slots__ = ("prefill", "draft", "draft_ahead")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_FIELD_NUMBER: _ClassVar[int]
    prefill: DrafterPrefillResponse
    draft: DraftResponse
    draft_ahead: DraftAheadResponse
    def __init__(self, prefill: _Optional[_Union[DrafterPrefillResponse, _Mapping]] = ..., draft: _Optional[_Union[DraftResponse, _Mapping]] = ..., draft_ahead: _Optional[_Union[DraftAheadResponse, _Mapping]] = ...) -> None: ...
