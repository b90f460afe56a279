"""Conversions between the specdec.v1 messages and the core types, both ways.

The SDK, the CLI and the three services convert here and nowhere else: a
server turns the proto it receives into ``specdec.request.params`` dataclasses at the
top of its handler and works with those. Validation happens on the way in: a
malformed message becomes an ``InvalidArgument`` whose text names the
offending field the way a client wrote it (``tree.parents[3] = 5 is not in
[0, 3) ...``, ``features.shape [2, 4] needs 32 bytes ...``,
``tree.value_temperature must be >= 0 ...``), so services can return it as is.
The bounds themselves are ``specdec.request.params``'s; this module only adds what is
the wire's own (unknown enum values, 0 meaning unset).

Everything here is torch-free: the orchestrator and the SDK, which never
import torch, use this module for parameters and requests and forward
``Tensor`` messages between verifier and drafter as they are. Tensors and
draft trees convert in ``specdec.serving.tensor_wire`` (drafter, verifier, local runs).
"""

from __future__ import annotations

import sys
from dataclasses import replace

from specdec.request.constraints import CONSTRAINT_KINDS, Constraint
from specdec.request.errors import InvalidArgument
from specdec.request.params import (PROPOSALS, REQUEST_METHODS, TREE_KNOBS, ChatMessage, GenerationRequest, SamplingParams,
                                    TokenLogprob, TreeParams, TreeRequest, check_max_new_tokens)
from specdec.v1 import common_pb2, orchestrator_pb2

def _enum_suffix(name: str) -> str:
    return name.upper().replace("-", "_")


# Built from the one list in specdec.request.params: a method or mode the proto lacks
# fails here, at import, not on the first request that uses it.
METHOD_TO_PROTO: dict[str, int] = {m: common_pb2.TreeMethod.Value(f"TREE_METHOD_{_enum_suffix(m)}")
                                   for m in REQUEST_METHODS}
METHOD_FROM_PROTO: dict[int, str] = {v: k for k, v in METHOD_TO_PROTO.items()}
PROPOSALS_TO_PROTO: dict[str, int] = {p: common_pb2.Proposals.Value(f"PROPOSALS_{_enum_suffix(p)}")
                                      for p in PROPOSALS}
PROPOSALS_FROM_PROTO: dict[int, str] = {v: k for k, v in PROPOSALS_TO_PROTO.items()}
CONSTRAINT_TO_PROTO: dict[str, int] = {k: common_pb2.ConstraintKind.Value(f"CONSTRAINT_KIND_{_enum_suffix(k)}")
                                       for k in CONSTRAINT_KINDS}
CONSTRAINT_FROM_PROTO: dict[int, str] = {v: k for k, v in CONSTRAINT_TO_PROTO.items()}

# dtype name -> bytes per element. Bytes travel in the host's order, which the
# check below pins to little-endian (the wire format).
if sys.byteorder != "little":
    raise ImportError("specdec.request.wire assumes a little-endian host")
TENSOR_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}


# -- parameters --------------------------------------------------------------------
def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                    min_p=params.min_p, presence_penalty=params.presence_penalty,
                                    frequency_penalty=params.frequency_penalty,
                                    repetition_penalty=params.repetition_penalty,
                                    logit_bias=dict(params.logit_bias))
    if params.seed is not None:
        msg.seed = params.seed
    if params.constraint is not None:
        msg.constraint.kind = CONSTRAINT_TO_PROTO[params.constraint.kind]
        msg.constraint.value = params.constraint.value
    return msg


def constraint_from_proto(msg: common_pb2.SamplingParams) -> Constraint | None:
    """The message's constraint, unchecked (None when unset or UNSPECIFIED)."""
    if not msg.HasField("constraint") or msg.constraint.kind == common_pb2.CONSTRAINT_KIND_UNSPECIFIED:
        return None
    kind = _enum_name(msg.constraint.kind, CONSTRAINT_FROM_PROTO, "sampling.constraint.kind", "ConstraintKind")
    return Constraint(kind, msg.constraint.value)


def sampling_from_proto(msg: common_pb2.SamplingParams, field: str = "sampling") -> SamplingParams:
    """Validated SamplingParams; top_p and repetition_penalty 0 (unset) read as
    1, an unset seed as None, an empty logit_bias as none."""
    return unchecked_sampling(msg).validate(field)


def unchecked_sampling(msg: common_pb2.SamplingParams) -> SamplingParams:
    """SamplingParams as the message says, for a caller that validates them in its own order."""
    return SamplingParams(temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p or 1.0,
                          seed=msg.seed if msg.HasField("seed") else None, min_p=msg.min_p,
                          presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
                          repetition_penalty=msg.repetition_penalty or 1.0, logit_bias=dict(msg.logit_bias),
                          constraint=constraint_from_proto(msg))


def tree_params_to_proto(cfg: TreeParams | None) -> common_pb2.TreeParams:
    """Resolved knobs (static_shape stays with the drafter's defaults); None
    (no drafting) is the VANILLA method."""
    if cfg is None:
        return common_pb2.TreeParams(method=common_pb2.TREE_METHOD_VANILLA)
    return common_pb2.TreeParams(method=METHOD_TO_PROTO[cfg.method], total_tokens=cfg.total_tokens,
                                 depth=cfg.depth, expand_k=cfg.expand_k,
                                 value_temperature=cfg.value_temperature or 0.0,
                                 proposals=PROPOSALS_TO_PROTO[cfg.proposals])


def tree_request_to_proto(req: TreeRequest) -> common_pb2.TreeParams:
    method = METHOD_TO_PROTO[req.method] if req.method else common_pb2.TREE_METHOD_UNSPECIFIED
    return common_pb2.TreeParams(method=method, total_tokens=req.total_tokens, depth=req.depth,
                                 expand_k=req.expand_k, value_temperature=req.value_temperature,
                                 proposals=PROPOSALS_TO_PROTO[req.proposals])


def _enum_name(value: int, names: dict[int, str], field: str, what: str) -> str:
    if value not in names:
        raise InvalidArgument(f"{field} {value} is not a known {what}")
    return names[value]


def tree_request_from_proto(msg: common_pb2.TreeParams) -> TreeRequest:
    """A request's validated tree knobs (UNSPECIFIED / 0 / AUTO: the server's)."""
    method = "" if msg.method == common_pb2.TREE_METHOD_UNSPECIFIED else \
        _enum_name(msg.method, METHOD_FROM_PROTO, "tree.method", "TreeMethod")
    return TreeRequest(method=method, total_tokens=msg.total_tokens, depth=msg.depth, expand_k=msg.expand_k,
                       value_temperature=msg.value_temperature,
                       proposals=_enum_name(msg.proposals, PROPOSALS_FROM_PROTO, "tree.proposals", "Proposals value"))


def tree_config_from_proto(msg: common_pb2.TreeParams, default: TreeParams, limits: TreeParams) -> TreeParams | None:
    """The knobs a drafter builds with: unset ones take ``default``, every one
    is clamped to ``limits``. VANILLA (no drafting) gives None."""
    return tree_request_from_proto(msg).resolve(default, limits)


def enum_to_proto(name: str, table: dict[str, int], field: str) -> int:
    """A method / proposals name as its enum value; InvalidArgument naming ``field`` for an unknown one."""
    if name not in table:
        raise InvalidArgument(f"{field} must be one of {', '.join(table)}, got {name!r}")
    return table[name]


def generation_request_to_proto(req: GenerationRequest) -> orchestrator_pb2.GenerateRequest:
    msg = orchestrator_pb2.GenerateRequest(
        prompt=req.prompt, max_new_tokens=req.max_new_tokens, sampling=sampling_to_proto(req.sampling),
        stop=list(req.stop), tree=tree_request_to_proto(req.tree), request_id=req.request_id,
        prompt_ids=list(req.prompt_ids), n=req.n, prompt_only=req.prompt_only, cache_salt=req.cache_salt,
        messages=[orchestrator_pb2.ChatMessage(role=m.role, content=m.content) for m in req.messages])
    if req.logprobs is not None:
        msg.logprobs = req.logprobs
    if req.prompt_logprobs is not None:
        msg.prompt_logprobs = req.prompt_logprobs
    return msg


def generation_request_from_proto(msg: orchestrator_pb2.GenerateRequest,
                                  max_new_tokens_limit: int | None = None) -> GenerationRequest:
    """The validated public request: InvalidArgument names the first bad field in
    the order of ``specdec.request.params``' table (the prompt fields, logprobs,
    prompt_logprobs, n, max_new_tokens, prompt_only, max_new_tokens within the
    server's ``max_new_tokens_limit`` when given, sampling, stop, request_id,
    then the tree knobs)."""
    request = GenerationRequest(prompt=msg.prompt, max_new_tokens=msg.max_new_tokens,
                                prompt_ids=tuple(msg.prompt_ids),
                                messages=tuple(ChatMessage(m.role, m.content) for m in msg.messages),
                                logprobs=msg.logprobs if msg.HasField("logprobs") else None, n=msg.n or 1,
                                prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
                                prompt_only=msg.prompt_only, cache_salt=msg.cache_salt)
    if max_new_tokens_limit is not None:
        check_max_new_tokens(request.max_new_tokens, max_new_tokens_limit)
    request = replace(request, sampling=unchecked_sampling(msg.sampling), stop=tuple(msg.stop),
                      request_id=msg.request_id)
    return replace(request, tree=tree_request_from_proto(msg.tree))


# -- logprobs ----------------------------------------------------------------------
def logprobs_to_proto(entries) -> list[common_pb2.TokenLogprob]:
    """``specdec.request.params.TokenLogprob`` entries as messages."""
    return [common_pb2.TokenLogprob(token=e.token, logprob=e.logprob, top_tokens=list(e.top_tokens),
                                    top_logprobs=list(e.top_logprobs)) for e in entries]


def logprobs_from_proto(msgs) -> list[TokenLogprob]:
    return [TokenLogprob(m.token, m.logprob, tuple(m.top_tokens), tuple(m.top_logprobs)) for m in msgs]


class FeatureLog:
    """Feature rows ([n, H] ``Tensor`` messages) in the order the verifier sent them."""

    def __init__(self) -> None:
        self.parts: list[common_pb2.Tensor] = []
        self.rows = 0
        self.dtype: str | None = None
        self.hidden: int | None = None

    def add(self, msg: common_pb2.Tensor) -> None:
        """Append one message; ValueError if it does not continue the others."""
        shape = list(msg.shape)
        if len(shape) != 2 or msg.dtype not in TENSOR_DTYPES:
            raise ValueError(f"features must be a 2-D tensor of {', '.join(TENSOR_DTYPES)}, "
                             f"got {msg.dtype or 'no dtype'} {shape}")
        rows, hidden = shape
        if len(msg.data) != rows * hidden * TENSOR_DTYPES[msg.dtype]:
            raise ValueError(f"features of shape {shape} ({msg.dtype}) carry {len(msg.data)} bytes")
        if self.dtype is not None and (msg.dtype, hidden) != (self.dtype, self.hidden):
            raise ValueError(f"features changed from {self.dtype} [*, {self.hidden}] to {msg.dtype} [*, {hidden}]")
        self.dtype, self.hidden = msg.dtype, hidden
        self.parts.append(msg)
        self.rows += rows

    def clear(self) -> None:
        self.parts.clear()
        self.rows = 0

    def tensor(self) -> common_pb2.Tensor | None:
        """All rows as one [rows, H] message; None when nothing was added."""
        if not self.parts:
            return None
        if len(self.parts) == 1:
            return self.parts[0]
        return common_pb2.Tensor(data=b"".join(p.data for p in self.parts), dtype=self.dtype,
                                 shape=[self.rows, self.hidden])


def clamp_tree(params: common_pb2.TreeParams, limits: common_pb2.TreeParams) -> common_pb2.TreeParams:
    """``params`` with each knob at most the drafter's limit (0: no limit)."""
    out = common_pb2.TreeParams()
    out.CopyFrom(params)
    for name in TREE_KNOBS:
        limit = getattr(limits, name)
        if limit > 0:
            setattr(out, name, min(getattr(out, name), limit))
    return out
