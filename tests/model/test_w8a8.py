"""Int8 weights times int8 activations (``--weights w8a8``, ``specdec.model.w8a8``):
the kernel computes the documented sum (activation codes per block of 32,
exact int32 block sums, fp32 block scaling in order); its VNNI and portable
loops agree bit for bit; a row's products do not depend on the rows beside
it; a layer the kernel cannot take is held in weight-only int8 with one log
line; a bad kernel setting is refused in one line."""

from __future__ import annotations

import logging

import pytest
import torch

from specdec.model.quantize import Int8Linear, quantize_linears
from specdec.model.w8a8 import BLOCK, KERNEL_ENV, W8A8Linear, use_vnni


def _reference(layer: W8A8Linear, x: torch.Tensor) -> torch.Tensor:
    """The module docstring's sum, in float64: codes round(x · 127 / amax) per
    block of 32, each block's integer dot times amax / 127, summed, times the
    output's scale."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    codes = torch.round(blocks * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    weights = torch.round(layer.dequantized() / layer.scales[:layer.out_features, None])
    dots = torch.einsum("rbk,nbk->rnb", codes.double(), weights.reshape(-1, k // BLOCK, BLOCK).double())
    return (dots * (amax / 127).squeeze(-1)[:, None, :].double()).sum(-1) * layer.scales[:layer.out_features].double()


@pytest.mark.parametrize("shape", [(37, 64), (96, 128), (48, 1536)])
def test_the_kernel_computes_the_documented_sum(shape):
    torch.manual_seed(0)
    linear = torch.nn.Linear(shape[1], shape[0], bias=False)
    layer = W8A8Linear(linear.weight)
    x = torch.randn(11, shape[1]) * torch.linspace(0.1, 5.0, shape[1])      # blocks of different ranges
    x[3, :BLOCK] = 0.0                                                        # a block of zeros
    got = layer(x)
    want = _reference(layer, x)
    assert got.shape == (11, shape[0]) and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # and it is close to the dense product it stands for (int8 weights and activations: ~1%)
    dense = x @ linear.weight.detach().t()
    assert float((got - dense).norm() / dense.norm()) < 0.02


def test_a_row_does_not_depend_on_the_rows_beside_it_and_both_loops_agree(monkeypatch):
    torch.manual_seed(1)
    weight, bias = torch.randn(200, 256), torch.randn(200)
    layer = W8A8Linear(weight, bias)
    x = torch.randn(19, 256)
    together = layer(x)
    for i in range(19):                                    # one row, as a one-token step computes it
        assert torch.equal(layer(x[i:i + 1]), together[i:i + 1])
    assert torch.equal(layer(x[4:13]), together[4:13])     # a tree's rows, as a verify computes them
    assert layer.vnni
    monkeypatch.setenv(KERNEL_ENV, "portable")
    portable = W8A8Linear(weight, bias)
    assert not portable.vnni
    assert torch.equal(portable(x), together)


def test_a_bfloat16_model_gets_bfloat16_outputs_of_the_same_products():
    torch.manual_seed(2)
    layer = W8A8Linear(torch.randn(64, 96))
    x = torch.randn(5, 96).to(torch.bfloat16)
    got = layer(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, layer(x.float()).to(torch.bfloat16))


def test_a_layer_the_kernel_cannot_take_is_held_in_int8(caplog):
    from tiny import tiny_llama

    model = tiny_llama(300, seed=0, hidden=48)              # 48 inputs: not whole blocks of 32
    with caplog.at_level(logging.WARNING, logger="specdec.model.quantize"):
        kinds = quantize_linears(model, "w8a8")
    assert set(kinds.values()) == {"int8", "w8a8"}
    assert kinds["model.layers.0.self_attn.q_proj"] == "int8" and type(model.lm_head) is Int8Linear
    held = [name for name, kind in kinds.items() if kind == "int8"]
    lines = [r.getMessage() for r in caplog.records if "held in int8" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(
        f"w8a8 weights: {len(held)} layer(s) held in int8 (weight-only) instead (the w8a8 kernel needs the input "
        f"width a multiple of {BLOCK}): ")
    with pytest.raises(ValueError, match=r"^w8a8 needs the input width a multiple of 32, got 48$"):
        W8A8Linear(torch.zeros(16, 48))


def test_a_bad_kernel_setting_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv(KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match=r"^SPECDEC_W8A8_KERNEL must be one of auto, portable, got 'fast'$"):
        use_vnni()
