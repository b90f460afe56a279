from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ConstraintKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONSTRAINT_KIND_UNSPECIFIED: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_JSON_OBJECT: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_JSON_SCHEMA: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_REGEX: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_GRAMMAR: _ClassVar[ConstraintKind]

class TreeMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TREE_METHOD_UNSPECIFIED: _ClassVar[TreeMethod]
    TREE_METHOD_EAGLE2: _ClassVar[TreeMethod]
    TREE_METHOD_STATIC: _ClassVar[TreeMethod]
    TREE_METHOD_CHAIN: _ClassVar[TreeMethod]
    TREE_METHOD_NO_VALUE: _ClassVar[TreeMethod]
    TREE_METHOD_NO_RERANK: _ClassVar[TreeMethod]
    TREE_METHOD_VANILLA: _ClassVar[TreeMethod]
    TREE_METHOD_LOOKAHEAD: _ClassVar[TreeMethod]

class Proposals(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROPOSALS_AUTO: _ClassVar[Proposals]
    PROPOSALS_TOP: _ClassVar[Proposals]
    PROPOSALS_SAMPLED: _ClassVar[Proposals]
CONSTRAINT_KIND_UNSPECIFIED: ConstraintKind
CONSTRAINT_KIND_JSON_OBJECT: ConstraintKind
CONSTRAINT_KIND_JSON_SCHEMA: ConstraintKind
CONSTRAINT_KIND_REGEX: ConstraintKind
CONSTRAINT_KIND_GRAMMAR: ConstraintKind
TREE_METHOD_UNSPECIFIED: TreeMethod
TREE_METHOD_EAGLE2: TreeMethod
TREE_METHOD_STATIC: TreeMethod
TREE_METHOD_CHAIN: TreeMethod
TREE_METHOD_NO_VALUE: TreeMethod
TREE_METHOD_NO_RERANK: TreeMethod
TREE_METHOD_VANILLA: TreeMethod
TREE_METHOD_LOOKAHEAD: TreeMethod
PROPOSALS_AUTO: Proposals
PROPOSALS_TOP: Proposals
PROPOSALS_SAMPLED: Proposals

class Tensor(_message.Message):
    __slots__ = ("data", "dtype", "shape")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, data: _Optional[bytes] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "constraint")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    constraint: Constraint
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("kind", "value")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    kind: ConstraintKind
    value: str
    def __init__(self, kind: _Optional[_Union[ConstraintKind, str]] = ..., value: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token", "logprob", "top_tokens", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprob: float
    top_tokens: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token: _Optional[int] = ..., logprob: _Optional[float] = ..., top_tokens: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class TreeParams(_message.Message):
    __slots__ = ("method", "total_tokens", "depth", "expand_k", "value_temperature", "proposals")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    EXPAND_K_FIELD_NUMBER: _ClassVar[int]
    VALUE_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    method: TreeMethod
    total_tokens: int
    depth: int
    expand_k: int
    value_temperature: float
    proposals: Proposals
    def __init__(self, method: _Optional[_Union[TreeMethod, str]] = ..., total_tokens: _Optional[int] = ..., depth: _Optional[int] = ..., expand_k: _Optional[int] = ..., value_temperature: _Optional[float] = ..., proposals: _Optional[_Union[Proposals, str]] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("tokens", "parents", "values", "proposals")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    proposals: _containers.RepeatedCompositeFieldContainer[Proposal]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., values: _Optional[_Iterable[float]] = ..., proposals: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("node", "tokens", "probs")
    NODE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    node: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, node: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...
