"""Conversions between the specdec.v1 messages and the core types.

Validation happens here, at the edge: a malformed message becomes an
``InvalidArgument`` whose text names the offending field the way a client
wrote it (``tree.parents[3] = 5 is not in [0, 3) ...``,
``features.shape [2, 4] needs 32 bytes ...``), so services can return it as is.

torch and the core modules are imported inside the functions: the orchestrator
(no torch) imports this module for the enum maps and only forwards ``Tensor``
messages between the verifier and the drafter.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING

from specdec.errors import InvalidArgument
from specdec.v1 import common_pb2

if TYPE_CHECKING:
    import torch

    from specdec.params import SamplingParams
    from specdec.params import TreeParams
    from specdec.tree import DraftTree

METHOD_TO_PROTO: dict[str, int] = {
    "eagle2": common_pb2.TREE_METHOD_EAGLE2,
    "static": common_pb2.TREE_METHOD_STATIC,
    "chain": common_pb2.TREE_METHOD_CHAIN,
    "no-value": common_pb2.TREE_METHOD_NO_VALUE,
    "no-rerank": common_pb2.TREE_METHOD_NO_RERANK,
    "vanilla": common_pb2.TREE_METHOD_VANILLA,
}
METHOD_FROM_PROTO: dict[int, str] = {v: k for k, v in METHOD_TO_PROTO.items()}
PROPOSALS_TO_PROTO: dict[str, int] = {
    "auto": common_pb2.PROPOSALS_AUTO,
    "top": common_pb2.PROPOSALS_TOP,
    "sampled": common_pb2.PROPOSALS_SAMPLED,
}
PROPOSALS_FROM_PROTO: dict[int, str] = {v: k for k, v in PROPOSALS_TO_PROTO.items()}

# dtype name -> bytes per element. Bytes travel in the host's order, which the
# check below pins to little-endian (the wire format).
if sys.byteorder != "little":
    raise ImportError("specdec.wire assumes a little-endian host")
TENSOR_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}


# -- tensors -------------------------------------------------------------------
def tensor_to_proto(t: torch.Tensor, dtype: str = "float32") -> common_pb2.Tensor:
    """A dense tensor as raw little-endian bytes + dtype + shape."""
    import torch

    if dtype not in TENSOR_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(TENSOR_DTYPES)}, got {dtype!r}")
    t = t.detach().to(device="cpu", dtype=getattr(torch, dtype)).contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return common_pb2.Tensor(data=raw, dtype=dtype, shape=list(t.shape))


def tensor_from_proto(msg: common_pb2.Tensor, field: str = "features") -> torch.Tensor | None:
    """The tensor a message carries, in its wire dtype; None when it carries no data."""
    import torch

    if not msg.data and not msg.shape:
        return None
    if msg.dtype not in TENSOR_DTYPES:
        raise InvalidArgument(f"{field}.dtype must be one of {', '.join(TENSOR_DTYPES)}, got {msg.dtype!r}")
    shape = list(msg.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"{field}.shape {shape} has a negative dimension")
    size = TENSOR_DTYPES[msg.dtype] * math.prod(shape)
    if size != len(msg.data):
        raise InvalidArgument(f"{field}.shape {shape} of {msg.dtype} needs {size} bytes, "
                              f"{field}.data has {len(msg.data)}")
    if size == 0:
        return torch.empty(shape, dtype=getattr(torch, msg.dtype))
    raw = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8)
    return raw.view(getattr(torch, msg.dtype)).reshape(shape)


# -- draft trees -------------------------------------------------------------------
def tree_to_proto(tree: DraftTree) -> common_pb2.DraftTree:
    proposals = [common_pb2.Proposal(node=node, tokens=prop.tokens.tolist(), probs=prop.probs.tolist())
                 for node, prop in sorted((tree.proposals or {}).items())]
    return common_pb2.DraftTree(tokens=tree.tokens.tolist(), parents=tree.parents.tolist(),
                                values=tree.values.tolist(), proposals=proposals)


def _proposals_from_proto(msg: common_pb2.DraftTree, tree: DraftTree, vocab_size: int | None, field: str):
    """The checked proposals of a wire tree, None when it has none."""
    import torch

    from specdec.proposals import Proposal, ProposalError, check_proposals

    if not msg.proposals:
        return None
    props = {}
    for i, prop in enumerate(msg.proposals):
        if prop.node in props:
            raise InvalidArgument(f"{field}.proposals[{i}]: node {prop.node} has two proposals")
        props[prop.node] = Proposal(torch.tensor(list(prop.tokens), dtype=torch.int64),
                                    torch.tensor(list(prop.probs), dtype=torch.float32))
    try:
        return check_proposals(props, tree.tokens.tolist(), tree.parents.tolist(), vocab_size)
    except ProposalError as exc:
        raise InvalidArgument(f"{field}.proposals: {exc}") from None


def tree_from_proto(msg: common_pb2.DraftTree, vocab_size: int | None = None, field: str = "tree") -> DraftTree:
    """A validated DraftTree; ``values`` are optional (zeros when absent)."""
    import torch

    from specdec.tree import DraftTree, TreeError, tree_from_lists

    try:
        tree = tree_from_lists(list(msg.tokens), list(msg.parents), vocab_size)
    except TreeError as exc:
        raise InvalidArgument(f"{field}.{exc}") from None
    proposals = _proposals_from_proto(msg, tree, vocab_size, field)
    if not msg.values:
        return tree if proposals is None else DraftTree(tree.tokens, tree.parents, tree.depths, tree.values, proposals)
    if len(msg.values) != tree.size:
        raise InvalidArgument(f"{field}.values has {len(msg.values)} entries for {tree.size} nodes "
                              "(send one per node or none)")
    values = torch.tensor(list(msg.values), dtype=torch.float32)
    nan = torch.isnan(values).nonzero()
    if len(nan):
        raise InvalidArgument(f"{field}.values[{int(nan[0])}] is NaN")
    return DraftTree(tokens=tree.tokens, parents=tree.parents, depths=tree.depths, values=values,
                     proposals=proposals)


# -- parameters --------------------------------------------------------------------
def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def sampling_from_proto(msg: common_pb2.SamplingParams, field: str = "sampling") -> SamplingParams:
    """Validated SamplingParams; top_p 0 (unset) reads as 1, an unset seed as None."""
    from specdec.params import SamplingParams

    params = SamplingParams(temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p or 1.0,
                            seed=msg.seed if msg.HasField("seed") else None)
    try:
        params.validate()
    except ValueError as exc:
        raise InvalidArgument(f"{field}.{exc}") from None
    return params


def tree_params_to_proto(cfg: TreeParams | None) -> common_pb2.TreeParams:
    """None (no drafting) is the VANILLA method."""
    if cfg is None:
        return common_pb2.TreeParams(method=common_pb2.TREE_METHOD_VANILLA)
    return common_pb2.TreeParams(method=METHOD_TO_PROTO[cfg.method], total_tokens=cfg.total_tokens,
                                 depth=cfg.depth, expand_k=cfg.expand_k,
                                 value_temperature=cfg.value_temperature or 0.0,
                                 proposals=PROPOSALS_TO_PROTO[cfg.proposals])


def _enum_value(value: int, unset: int, default: str, names: dict[int, str], field: str, what: str) -> str:
    """The name of an enum field's value; ``unset`` takes ``default``."""
    if value == unset:
        return default
    if value not in names:
        raise InvalidArgument(f"{field} {value} is not a known {what}")
    return names[value]


def tree_config_from_proto(msg: common_pb2.TreeParams, default: TreeParams, limits: TreeParams,
                           field: str = "tree") -> TreeParams | None:
    """The tree knobs of a request: 0 / UNSPECIFIED take ``default``, then every
    knob is clamped to ``limits``. VANILLA (no drafting) gives None."""
    from dataclasses import replace

    if msg.method == common_pb2.TREE_METHOD_VANILLA:
        return None
    method = _enum_value(msg.method, common_pb2.TREE_METHOD_UNSPECIFIED, default.method, METHOD_FROM_PROTO,
                         f"{field}.method", "TreeMethod")
    knobs = {}
    for name in ("total_tokens", "depth", "expand_k"):
        value = getattr(msg, name)
        if value < 0:
            raise InvalidArgument(f"{field}.{name} must be >= 0 (0 = server default), got {value}")
        knobs[name] = min(value or getattr(default, name), getattr(limits, name))
    static_shape = default.static_shape if method == default.method else None
    t = msg.value_temperature
    if not (t >= 0 and math.isfinite(t)):
        raise InvalidArgument(f"{field}.value_temperature must be >= 0 (0 = the drafter's choice), got {t}")
    proposals = _enum_value(msg.proposals, common_pb2.PROPOSALS_AUTO, default.proposals, PROPOSALS_FROM_PROTO,
                            f"{field}.proposals", "Proposals value")
    return replace(default, method=method, static_shape=static_shape, value_temperature=t or default.value_temperature,
                   proposals=proposals, **knobs)
