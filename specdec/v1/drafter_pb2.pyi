from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrafterPrefillRequest(_message.Message):
    __slots__ = ("session_id", "token_ids", "features", "greedy")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    features: _common_pb2.Tensor
    greedy: bool
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., greedy: _Optional[bool] = ...) -> None: ...

class DrafterPrefillResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("session_id", "commit_tokens", "commit_features", "tree")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    commit_tokens: _containers.RepeatedScalarFieldContainer[int]
    commit_features: _common_pb2.Tensor
    tree: _common_pb2.TreeParams
    def __init__(self, session_id: _Optional[str] = ..., commit_tokens: _Optional[_Iterable[int]] = ..., commit_features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., tree: _Optional[_Union[_common_pb2.TreeParams, _Mapping]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("tree", "compute_s")
    TREE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    tree: _common_pb2.DraftTree
    compute_s: float
    def __init__(self, tree: _Optional[_Union[_common_pb2.DraftTree, _Mapping]] = ..., compute_s: _Optional[float] = ...) -> None: ...

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
    __slots__ = ("kind", "needs_features", "vocab_size", "active_sessions", "max_sessions", "max_tree")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NEEDS_FEATURES_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    needs_features: bool
    vocab_size: int
    active_sessions: int
    max_sessions: int
    max_tree: _common_pb2.TreeParams
    def __init__(self, kind: _Optional[str] = ..., needs_features: _Optional[bool] = ..., vocab_size: _Optional[int] = ..., active_sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_tree: _Optional[_Union[_common_pb2.TreeParams, _Mapping]] = ...) -> None: ...
