"""Tensors and draft trees to and from their specdec.v1 messages.

The torch side of ``specdec.request.wire``: the drafter, the verifier and in-process
runs convert here; the orchestrator never does (it forwards ``Tensor``
messages as they are and passes trees through), so it never imports torch.
Validation as in ``specdec.request.wire``: a malformed message is an
``InvalidArgument`` naming the field (``tree.parents[3] = 5 is not in
[0, 3) ...``, ``features.shape [2, 4] needs 32 bytes ...``).
"""

from __future__ import annotations

import math

import torch

from specdec.request.errors import InvalidArgument
from specdec.request.wire import TENSOR_DTYPES
from specdec.tree.build import DraftTree, TreeError, tree_from_lists
from specdec.tree.proposals import Proposal, ProposalError, check_proposals
from specdec.v1 import common_pb2


# -- tensors -------------------------------------------------------------------
def tensor_to_proto(t: torch.Tensor, dtype: str = "float32") -> common_pb2.Tensor:
    """A dense tensor as raw little-endian bytes + dtype + shape."""
    if dtype not in TENSOR_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(TENSOR_DTYPES)}, got {dtype!r}")
    t = t.detach().to(device="cpu", dtype=getattr(torch, dtype)).contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return common_pb2.Tensor(data=raw, dtype=dtype, shape=list(t.shape))


def tensor_from_proto(msg: common_pb2.Tensor, field: str = "features") -> torch.Tensor | None:
    """The tensor a message carries, in its wire dtype; None when it carries no data."""
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
