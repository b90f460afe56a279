"""specdec.request.wire: round trips and validation messages that name the field."""

import math

import pytest
import torch

from specdec.request import wire
from specdec.request.errors import InvalidArgument
from specdec.request.params import METHODS, GenerationRequest, SamplingParams, TreeParams
from specdec.serving import tensor_wire
from specdec.tree.build import DraftTree, tree_from_lists
from specdec.v1 import common_pb2


# -- tensors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_tensor_round_trip(dtype):
    t = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    msg = tensor_wire.tensor_to_proto(t, dtype)
    assert msg.dtype == dtype and list(msg.shape) == [5, 7]
    assert len(msg.data) == 35 * wire.TENSOR_DTYPES[dtype]
    back = tensor_wire.tensor_from_proto(common_pb2.Tensor.FromString(msg.SerializeToString()))
    assert back.dtype == getattr(torch, dtype) and back.shape == (5, 7)
    assert torch.equal(back, t.to(getattr(torch, dtype)))   # exact after the one cast


def test_tensor_float32_bytes_are_little_endian():
    msg = tensor_wire.tensor_to_proto(torch.tensor([1.0]))
    assert msg.data == b"\x00\x00\x80\x3f"


def test_empty_tensor_message_is_none_and_zero_rows_survive():
    assert tensor_wire.tensor_from_proto(common_pb2.Tensor()) is None
    back = tensor_wire.tensor_from_proto(tensor_wire.tensor_to_proto(torch.zeros(0, 4)))
    assert back is not None and back.shape == (0, 4)


@pytest.mark.parametrize("msg, words", [
    (common_pb2.Tensor(data=b"\0" * 8, dtype="int8", shape=[8]), "commit_features.dtype"),
    (common_pb2.Tensor(data=b"\0" * 8, dtype="float32", shape=[3]), "commit_features.shape [3]"),
    (common_pb2.Tensor(data=b"\0" * 8, dtype="float32", shape=[-1, -2]), "negative"),
    (common_pb2.Tensor(data=b"\0" * 6, dtype="float16", shape=[2, 2]), "needs 8 bytes"),
])
def test_tensor_validation_names_the_field(msg, words):
    with pytest.raises(InvalidArgument, match=words.replace("[", r"\[")):
        tensor_wire.tensor_from_proto(msg, "commit_features")


def test_tensor_to_proto_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="dtype"):
        tensor_wire.tensor_to_proto(torch.zeros(2), "int64")


# -- trees -------------------------------------------------------------------------------------------
def test_tree_round_trip_keeps_values():
    base = tree_from_lists([7, 3, 4, 9], [-1, 0, 0, 1])
    tree = DraftTree(tokens=base.tokens, parents=base.parents, depths=base.depths,
                     values=torch.tensor([0.0, -0.5, -1.25, -2.0]))
    msg = common_pb2.DraftTree.FromString(tensor_wire.tree_to_proto(tree).SerializeToString())
    assert list(msg.parents) == [-1, 0, 0, 1]
    back = tensor_wire.tree_from_proto(msg, vocab_size=10)
    for name in ("tokens", "parents", "depths", "values"):
        assert torch.equal(getattr(back, name), getattr(tree, name)), name


def test_tree_round_trip_keeps_proposals():
    from specdec.tree.proposals import Proposal

    base = tree_from_lists([7, 3, 4, 9], [-1, 0, 0, 1])
    props = {0: Proposal(torch.tensor([4, 3, 8]), torch.tensor([0.5, 0.25, 0.25])),
             1: Proposal(torch.tensor([9]), torch.tensor([1.0]))}
    tree = DraftTree(base.tokens, base.parents, base.depths, base.values, props)
    back = tensor_wire.tree_from_proto(common_pb2.DraftTree.FromString(tensor_wire.tree_to_proto(tree).SerializeToString()),
                                vocab_size=10)
    assert set(back.proposals) == {0, 1}
    for node, prop in props.items():
        assert torch.equal(back.proposals[node].tokens, prop.tokens)
        assert torch.equal(back.proposals[node].probs, prop.probs)
    assert tensor_wire.tree_from_proto(tensor_wire.tree_to_proto(base)).proposals is None


def test_tree_without_values_gets_zeros():
    back = tensor_wire.tree_from_proto(common_pb2.DraftTree(tokens=[1, 2], parents=[-1, 0]))
    assert back.values.tolist() == [0.0, 0.0] and back.depths.tolist() == [0, 1]


@pytest.mark.parametrize("tokens, parents, values, message", [
    ([1, 2, 3, 4], [-1, 0, 0, 5], [], r"^tree\.parents\[3\] = 5 is not in \[0, 3\)"),
    ([1, 2], [0, 0], [], r"^tree\.parents\[0\] = 0"),
    ([1, 2, 3], [-1, 0], [], r"^tree\.tokens and parents differ in length"),
    ([], [], [], r"^tree\.tree is empty"),
    ([1, 99], [-1, 0], [], r"^tree\.tokens\[1\] = 99 is outside the vocabulary \[0, 50\)"),
    ([1, -3], [-1, 0], [], r"^tree\.tokens\[1\] = -3 is negative"),
    ([1, 2], [-1, 0], [0.0], r"^tree\.values has 1 entries for 2 nodes"),
    ([1, 2], [-1, 0], [0.0, math.nan], r"^tree\.values\[1\] is NaN"),
])
def test_malformed_trees_name_the_field(tokens, parents, values, message):
    msg = common_pb2.DraftTree(tokens=tokens, parents=parents, values=values)
    with pytest.raises(InvalidArgument, match=message):
        tensor_wire.tree_from_proto(msg, vocab_size=50)


# -- sampling ----------------------------------------------------------------------------------------
def test_sampling_defaults_and_round_trip():
    params = wire.sampling_from_proto(common_pb2.SamplingParams())
    assert params == SamplingParams(temperature=0.0, top_k=0, top_p=1.0, seed=None)
    src = SamplingParams(temperature=0.5, top_k=20, top_p=0.75, seed=2**63 + 5)
    back = wire.sampling_from_proto(common_pb2.SamplingParams.FromString(
        wire.sampling_to_proto(src).SerializeToString()))
    assert back == src
    assert wire.sampling_from_proto(common_pb2.SamplingParams(seed=0)).seed == 0   # 0 is a seed, not "unset"


def test_logit_bias_round_trips_as_sorted_pairs():
    src = SamplingParams(temperature=0.5, logit_bias={900: -100.0, 3: 2.5, 17: 0.25})
    msg = common_pb2.SamplingParams.FromString(wire.sampling_to_proto(src).SerializeToString())
    assert dict(msg.logit_bias) == {900: -100.0, 3: 2.5, 17: 0.25}
    assert wire.sampling_from_proto(msg) == src and wire.sampling_from_proto(msg).logit_bias[0] == (3, 2.5)
    assert wire.sampling_from_proto(common_pb2.SamplingParams()).logit_bias == ()


def test_prompt_logprobs_and_prompt_only_round_trip():
    for req in (GenerationRequest("x", prompt_only=True, prompt_logprobs=0), GenerationRequest("x", max_new_tokens=4),
                GenerationRequest("x", prompt_logprobs=20, sampling=SamplingParams(logit_bias={1: 1.0}))):
        msg = wire.generation_request_to_proto(req)
        assert msg.HasField("prompt_logprobs") == (req.prompt_logprobs is not None)
        assert wire.generation_request_from_proto(msg) == req


@pytest.mark.parametrize("msg, field", [
    (common_pb2.SamplingParams(temperature=-1.0), "sampling.temperature"),
    (common_pb2.SamplingParams(temperature=math.inf), "sampling.temperature"),
    (common_pb2.SamplingParams(top_p=1.5), "sampling.top_p"),
    (common_pb2.SamplingParams(top_p=-0.1), "sampling.top_p"),
    (common_pb2.SamplingParams(top_k=-2), "sampling.top_k"),
    (common_pb2.SamplingParams(logit_bias={-4: 1.0}), "sampling.logit_bias"),
    (common_pb2.SamplingParams(logit_bias={4: 101.0}), r"sampling.logit_bias\[4\]"),
])
def test_bad_sampling_names_the_field(msg, field):
    with pytest.raises(InvalidArgument, match=f"^{field}"):
        wire.sampling_from_proto(msg)


# -- tree knobs --------------------------------------------------------------------------------------
DEFAULT = TreeParams(method="eagle2", total_tokens=12, depth=4, expand_k=3)
LIMITS = TreeParams(total_tokens=20, depth=5, expand_k=4)


def test_method_maps_cover_every_method():
    assert set(wire.METHOD_TO_PROTO) == set(METHODS) | {"lookahead", "vanilla"}
    assert all(wire.METHOD_FROM_PROTO[v] == k for k, v in wire.METHOD_TO_PROTO.items())
    assert common_pb2.TREE_METHOD_UNSPECIFIED not in wire.METHOD_FROM_PROTO


def test_tree_knobs_default_clamp_and_vanilla():
    assert wire.tree_config_from_proto(common_pb2.TreeParams(), DEFAULT, LIMITS) == DEFAULT
    cfg = wire.tree_config_from_proto(common_pb2.TreeParams(method=common_pb2.TREE_METHOD_CHAIN, total_tokens=500,
                                                            depth=2, expand_k=99), DEFAULT, LIMITS)
    assert cfg == TreeParams(method="chain", total_tokens=20, depth=2, expand_k=4)
    small_limits = TreeParams(total_tokens=6, depth=2, expand_k=2)
    assert wire.tree_config_from_proto(common_pb2.TreeParams(), DEFAULT, small_limits) == \
        TreeParams(method="eagle2", total_tokens=6, depth=2, expand_k=2)
    assert wire.tree_config_from_proto(common_pb2.TreeParams(method=common_pb2.TREE_METHOD_VANILLA),
                                       DEFAULT, LIMITS) is None


@pytest.mark.parametrize("cfg", [None, TreeParams(method="no-rerank", total_tokens=9, depth=3, expand_k=2),
                                 TreeParams(total_tokens=9, depth=3, expand_k=2, value_temperature=0.5),
                                 TreeParams(total_tokens=9, depth=3, expand_k=2, proposals="top"),
                                 TreeParams(method="chain", total_tokens=5, depth=4, expand_k=1, proposals="sampled")])
def test_tree_params_round_trip(cfg):
    msg = wire.tree_params_to_proto(cfg)
    assert wire.tree_config_from_proto(msg, DEFAULT, LIMITS) == cfg


@pytest.mark.parametrize("msg, message", [
    (common_pb2.TreeParams(total_tokens=-1), r"^tree\.total_tokens must be >= 0"),
    (common_pb2.TreeParams(depth=-3), r"^tree\.depth must be >= 0"),
    (common_pb2.TreeParams(expand_k=-1), r"^tree\.expand_k must be >= 0"),
    (common_pb2.TreeParams(method=42), r"^tree\.method 42 is not a known TreeMethod"),
    (common_pb2.TreeParams(proposals=9), r"^tree\.proposals 9 is not a known Proposals value"),
    (common_pb2.TreeParams(value_temperature=-1), r"^tree\.value_temperature must be >= 0"),
    (common_pb2.TreeParams(value_temperature=math.nan), r"^tree\.value_temperature must be >= 0"),
])
def test_bad_tree_knobs_name_the_field(msg, message):
    with pytest.raises(InvalidArgument, match=message):
        wire.tree_config_from_proto(msg, DEFAULT, LIMITS)
