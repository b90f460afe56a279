"""An EAGLE-3 head at ``--weights w8a8`` (``specdec.model.w8a8``): its decoder
layer and draft head are w8a8 while fc keeps its weights; speculation over a
w8a8 target with it is greedy-identical to that target's plain decoding;
``specdec up`` and the bench's services hand the head the mode."""

import pytest
import torch

from specdec.local import DrafterChoice, build_local, generate
from specdec.model.loading import ModelSpec
from specdec.model.quantize import QuantizedLinear
from specdec.model.w8a8 import W8A8Linear
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from drafter.eagle.eagle3 import load_eagle_drafter


def test_the_heads_layer_and_draft_head_are_w8a8_and_fc_is_kept(family3):
    head = load_eagle_drafter(family3["eagle3"], family3["target"], weights="w8a8").head
    # (this head is 48 wide: a layer reading 48 inputs is held in weight-only int8, one log line)
    assert type(head.fc) is torch.nn.Linear and isinstance(head.lm_head, QuantizedLinear)
    assert all(type(m) is not torch.nn.Linear for m in head.midlayer.modules())
    assert type(head.midlayer.self_attn.q_proj) is W8A8Linear          # 2 x 48 = 96 inputs: whole blocks
    plain = load_eagle_drafter(family3["eagle3"], family3["target"], weights="int8").head
    assert not any(isinstance(m, W8A8Linear) for m in plain.modules())     # other modes: heads as loaded


@pytest.mark.parametrize("method", ["eagle2", "chain"])
def test_speculation_with_a_w8a8_head_is_plain_decoding_of_the_w8a8_target(family3, method):
    stack = build_local(ModelSpec(str(family3["target"]), weights="w8a8"), DrafterChoice("eagle", str(family3["eagle3"])))
    assert type(stack.drafter.head.midlayer.self_attn.q_proj) is W8A8Linear
    stop = StopCriteria(max_new_tokens=24, eos_ids=frozenset())
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        prompt = torch.randint(1, stack.verifier.target.vocab_size, (9,), generator=gen).tolist()
        want = generate(stack.verifier, None, prompt, SamplingParams(), stop, None).tokens
        got = generate(stack.verifier, stack.drafter, prompt, SamplingParams(), stop,
                       TreeParams(method=method, total_tokens=12, depth=4, expand_k=4))
        assert got.tokens == want
    assert len(stack.verifier.sessions) == 0 and len(stack.drafter.sessions) == 0


def test_up_and_the_bench_hand_w8a8_to_the_head(family3):
    from specdec.bench.runner import BenchConfig
    from specdec.bench.services import drafter_argv
    from specdec.cli.main import build_parser
    from specdec.cli.up import _model_argv

    for weights in ("w8a8", "int8"):             # (the drafter quantizes a head at w8a8 only: above)
        args = build_parser().parse_args(["up", "--target", str(family3["target"]), "--eagle", str(family3["eagle3"]),
                                          "--weights", weights])
        _, drafter, _ = _model_argv(args)
        assert build_parser().parse_args(["drafter", "serve", *drafter]).weights == weights
        cfg = BenchConfig(target=str(family3["target"]), eagle3=str(family3["eagle3"]), weights=weights)
        assert build_parser().parse_args(["drafter", "serve", *drafter_argv(cfg, "eagle3")]).weights == weights
