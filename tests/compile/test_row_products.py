"""One-row products of half-precision linear layers compiled as streaming loops
(``specdec.compile.row_products``): installed only where they apply, eager
forwards unchanged, a traced one-row graph multiplies without a matrix product
while wider and batch-free graphs keep theirs, one-row attention of a marked
layer compiled as loops gives sdpa's output (additive, boolean, per-head or no
mask; grouped heads) with the query rotated once, not once a cached slot, while an unmarked layer or a
wider query keeps SDPA, and a bfloat16 model's compiled
one-token step (a package over its own weights, its directory keyed apart from
the other widths') gives eager's logits; ``SPECDEC_COMPILE_ROW_PRODUCTS=off`` takes it all back.
Int8 layers stream their one-row product over their int8 weights, an int8
model's compiled step gives eager's logits, and the packing budget counts its
int8 weights (buffers), not only its parameters."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from families import BY_NAME

from specdec.compile import forwards, row_products
from specdec.compile.eager import eager_forward
from specdec.model import attention
from specdec.model.loading import ROW_PRODUCTS_ENV, ModelSpec
from verifier.engine import TargetModel

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.linear.default,
           torch.ops.aten.bmm.default}


def _layers():
    torch.manual_seed(0)
    bf16 = torch.nn.Linear(64, 48).bfloat16()
    fp16 = torch.nn.Linear(64, 48, bias=False).half()
    fp32 = torch.nn.Linear(64, 48)
    input_major = torch.nn.Linear(64, 48).bfloat16()
    input_major.weight = torch.nn.Parameter(input_major.weight.detach().t().contiguous().t())
    return torch.nn.ModuleList([bf16, fp16, fp32, input_major])


def test_installed_on_half_precision_output_major_linears_only_and_eager_unchanged():
    layers = _layers()
    x = torch.randn(3, 64)
    want = [[F.linear(r.to(l.weight.dtype), l.weight, l.bias) for r in (x, x[:1])] for l in layers]
    assert row_products.install(layers) == 2
    bound = layers[0].forward
    assert row_products.install(layers) == 2 and layers[0].forward == bound      # once
    assert "forward" in vars(layers[0]) and "forward" in vars(layers[1])
    assert "forward" not in vars(layers[2]) and "forward" not in vars(layers[3])
    for layer, expected in zip(layers, want):        # eagerly, at one row and at three: the layer's own product
        assert torch.equal(layer(x.to(layer.weight.dtype)), expected[0])
        assert torch.equal(layer(x[:1].to(layer.weight.dtype)), expected[1])
    row_products.uninstall(layers)
    assert all("forward" not in vars(l) for l in layers)


class _Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 96).bfloat16()
        self.down = torch.nn.Linear(96, 32, bias=False).bfloat16()

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


def _ops(program) -> set:
    return {n.target for n in program.graph.nodes if n.op == "call_function"}


def test_a_traced_one_row_graph_multiplies_without_a_matrix_product():
    torch.manual_seed(1)
    model = _Two().eval()
    row_products.install(model)
    one, four = torch.randn(1, 1, 64).bfloat16(), torch.randn(1, 4, 64).bfloat16()
    with torch.no_grad():
        exported = torch.export.export(model, (one,), strict=False).run_decompositions()
        assert not _ops(exported) & MATMULS
        assert torch.ops.aten.sum.dim_IntList in _ops(exported)
        # each product's row is written out first (``materialized``), not recomputed beside every weight row
        assert {torch.ops.aten.index_copy.default, torch.ops.aten.index_put.default} & _ops(exported)
        got, want = exported.module()(one), model(one)        # eager: the BLAS product
        assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        wide = torch.export.export(model, (four,), strict=False).run_decompositions()
        assert _ops(wide) & MATMULS
        batch = torch.export.Dim("batch", min=2, max=64)
        free = torch.export.export(model, (torch.randn(2, 64).bfloat16(),), dynamic_shapes=({0: batch},),
                                   strict=False).run_decompositions()
        assert _ops(free) & MATMULS                  # a free batch is never taken for one row
    row_products.uninstall(model)
    with torch.no_grad():
        assert _ops(torch.export.export(model, (one,), strict=False).run_decompositions()) & MATMULS


class _Attention(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


def _mask(kind: str, dtype, slots: int = 40):
    if kind == "none":
        return None
    if kind == "bool":
        mask = torch.ones(1, 1, 1, slots, dtype=torch.bool)
        mask[..., 25:] = False
        return mask
    mask = torch.zeros(1, 9 if kind == "per-head" else 1, 1, slots, dtype=dtype)
    mask[:, -1 if kind == "per-head" else 0, :, 30:] = torch.finfo(dtype).min
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["additive", "bool", "per-head", "none"])
def test_one_row_attention_compiled_as_loops_gives_sdpa_output(dtype, kind):
    from transformers import AttentionInterface

    torch.manual_seed(2)
    layer = _Attention()
    row_products.install(torch.nn.ModuleList([layer, torch.nn.Linear(8, 8).bfloat16()]))
    assert AttentionInterface._global_mapping[attention.IMPLEMENTATION] is row_products.one_row_attention
    q, k, v = torch.randn(1, 9, 1, 64, dtype=dtype), torch.randn(1, 3, 40, 64, dtype=dtype), torch.randn(
        1, 3, 40, 64, dtype=dtype)
    mask = _mask(kind, dtype)
    traced = []

    def attend(q, k, v, mask):
        traced.append(torch.compiler.is_compiling())
        return row_products.one_row_attention(layer, q, k, v, mask, scaling=0.125)[0]

    got = torch.compile(attend, dynamic=False)(q, k, v, mask)
    want = attention.sdpa_forward(layer, q, k, v, mask, scaling=0.125)[0]
    assert traced == [True] and got.dtype == dtype and got.shape == want.shape == (1, 1, 9, 64)
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3
    assert torch.allclose(got.float(), want.float(), atol=tolerance, rtol=0)
    assert torch.equal(row_products.one_row_attention(layer, q, k, v, mask, scaling=0.125)[0], want)   # eager: sdpa


def _trigonometry_in_loops_over(code: str, bound: int) -> list[str]:
    """Lines of generated C++ taking a cosine or a sine inside a loop of ``bound`` iterations."""
    found, depth, loops = [], 0, []
    for line in code.splitlines():
        if "for(" in line and f"<static_cast<int64_t>({bound}L)" in line:
            loops.append(depth)
        if loops and any(call in line for call in (".cos()", ".sin()", "std::cos", "std::sin")):
            found.append(line.strip())
        depth += line.count("{") - line.count("}")
        while "}" in line and loops and depth <= loops[-1]:
            loops.pop()
    return found


def test_one_row_attention_rotates_the_query_once_not_once_a_cached_slot():
    """Inductor inlines pointwise work into each loop that reads it: the query's
    rotary embedding is written out before the score loop instead of being
    evaluated again for every cached slot (``row_products.materialized``)."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(3)
    layer = _Attention()
    row_products.install(torch.nn.ModuleList([layer, torch.nn.Linear(8, 8).bfloat16()]))
    q, angle = torch.randn(1, 9, 1, 64), torch.rand(1, 1, 1, 64) * 6
    k, v = torch.randn(1, 3, 40, 64).bfloat16(), torch.randn(1, 3, 40, 64).bfloat16()

    def rotated(q, angle):
        return (q * angle.cos() + torch.cat((-q[..., 32:], q[..., :32]), -1) * angle.sin()).bfloat16()

    def attend(q, angle, k, v):
        return row_products.one_row_attention(layer, rotated(q, angle), k, v, None, scaling=0.125)[0]

    got, code = run_and_get_code(torch.compile(attend, dynamic=False), q, angle, k, v)
    want = attention.sdpa_forward(layer, rotated(q, angle), k, v, None, scaling=0.125)[0]
    assert torch.allclose(got.float(), want.float(), atol=8e-3, rtol=0)
    source = "\n".join(code)
    assert ".cos()" in source or "std::cos" in source          # the rotation is compiled into the graph
    assert _trigonometry_in_loops_over(source, 40) == []        # but not into a loop over the 40 slots


def _attention_ops(layer, q, k, v) -> set:
    class Call(torch.nn.Module):
        def forward(self, q, k, v):
            return row_products.one_row_attention(layer, q, k, v, None)[0]

    with torch.no_grad():
        return _ops(torch.export.export(Call(), (q, k, v), strict=False))


def test_one_row_attention_only_for_marked_layers_at_one_query_row():
    layer, other = _Attention(), _Attention()
    row_products.install(torch.nn.ModuleList([layer, torch.nn.Linear(8, 8).bfloat16()]))
    k, v = torch.randn(1, 3, 40, 64), torch.randn(1, 3, 40, 64)
    flash = {torch.ops.aten.scaled_dot_product_attention.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
    assert not _attention_ops(layer, torch.randn(1, 9, 1, 64), k, v) & flash
    assert _attention_ops(layer, torch.randn(1, 9, 4, 64), k, v) & flash        # a tree's rows: sdpa
    assert _attention_ops(other, torch.randn(1, 9, 1, 64), k, v) & flash        # an unmarked layer: sdpa
    row_products.uninstall(torch.nn.ModuleList([layer]))
    assert _attention_ops(layer, torch.randn(1, 9, 1, 64), k, v) & flash


@pytest.fixture(scope="module")
def bf16_llama(family_dir):
    return TargetModel(ModelSpec(str(family_dir(BY_NAME["llama"])), dtype="bfloat16"))


def _one_token_logits(target, step, cache):
    with torch.inference_mode():
        target.lm.hidden(cache, torch.tensor([[5, 9, 2, 7]]), torch.arange(4)[None], None)
        return step(cache, torch.tensor([[3]]), torch.tensor([[4]]), None)[1]


def test_a_bf16_compiled_step_streams_its_products_and_gives_eager_logits(bf16_llama, monkeypatch):
    target = bf16_llama
    monkeypatch.setenv(ROW_PRODUCTS_ENV, "auto")
    forward = forwards.CompiledForward(target.lm, packed=False)
    assert forward.steps.root(1).name.endswith("-rows")          # one-row packages keyed apart, the others not
    assert forward.steps.root(16) == forward.packages and not forward.packages.name.endswith("-rows")
    assert all("forward" in vars(m) for m in target.lm.model.modules() if type(m) is torch.nn.Linear)
    forward.warm((1,))
    got = _one_token_logits(target, forward.forward, forward.new_cache(8))
    want = _one_token_logits(target, functools.partial(eager_forward, target.lm), target.lm.new_cache())
    assert torch.allclose(got, want, rtol=3e-2, atol=3e-2)
    assert torch.equal(got.argmax(-1), want.argmax(-1))

    monkeypatch.setenv(ROW_PRODUCTS_ENV, "off")
    plain = forwards.CompiledForward(target.lm, packed=False)
    assert plain.steps.root(1) == plain.packages == forward.packages
    assert not any("forward" in vars(m) for m in target.lm.model.modules())


def test_a_float32_model_is_left_as_it_is(family_dir):
    target = TargetModel(ModelSpec(str(family_dir(BY_NAME["llama"]))))
    forward = forwards.CompiledForward(target.lm, packed=False)
    assert forward.steps.root(1) == forward.packages and not forward.packages.name.endswith("-rows")
    assert not any("forward" in vars(m) for m in target.lm.model.modules())


def _int8_ops(layer, rows) -> set:
    class Call(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return self.layer(x)

    with torch.no_grad():
        return _ops(torch.export.export(Call(), (rows,), strict=False).run_decompositions())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_layer_streams_its_one_row_product_and_keeps_the_kernel_elsewhere(dtype):
    """Weight-only int8 layers (``specdec.model.quantize``) take the streaming
    one-row product too, over their int8 weights and per-output scales."""
    from specdec.model.quantize import Int8Linear

    torch.manual_seed(4)
    layer = Int8Linear(torch.randn(48, 64), torch.randn(48))
    x = torch.randn(3, 64).to(dtype)
    want = [layer(x), layer(x[:1])]
    assert row_products.install(torch.nn.ModuleList([layer])) == 1 and "product" in vars(layer)
    assert torch.equal(layer(x), want[0]) and torch.equal(layer(x[:1]), want[1])      # eagerly: the int8 kernel
    kernel = torch.ops.aten._weight_int8pack_mm.default
    one = _int8_ops(layer, x[:1])
    assert kernel not in one and torch.ops.aten.sum.dim_IntList in one
    assert kernel in _int8_ops(layer, x)                                 # three rows: the kernel
    got = torch.compile(layer, dynamic=False)(x[:1])
    # (both round each product to bfloat16 before the bias: one bf16 step at these magnitudes is 0.0625)
    assert got.dtype == want[1].dtype and torch.allclose(got.float(), want[1].float(), rtol=1e-2, atol=6e-2)
    row_products.uninstall(torch.nn.ModuleList([layer]))
    assert "product" not in vars(layer) and kernel in _int8_ops(layer, x[:1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_int8_compiled_step_streams_its_products_and_gives_eager_logits(family_dir, monkeypatch, dtype):
    from specdec.model.quantize import Int8Linear

    monkeypatch.setenv(ROW_PRODUCTS_ENV, "auto")
    target = TargetModel(ModelSpec(str(family_dir(BY_NAME["llama"])), dtype=dtype, weights="int8"))
    forward = forwards.CompiledForward(target.lm, packed=False)
    assert forward.steps.root(1).name.endswith("-rows")
    int8 = [m for m in target.lm.model.modules() if type(m) is Int8Linear]
    assert int8 and all("product" in vars(m) for m in int8)
    forward.warm((1,))
    got = _one_token_logits(target, forward.forward, forward.new_cache(8))
    want = _one_token_logits(target, functools.partial(eager_forward, target.lm), target.lm.new_cache())
    assert torch.allclose(got, want, rtol=3e-2, atol=3e-2)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_an_int8_model_is_packed_by_its_int8_weights_not_its_parameters(family_dir, monkeypatch):
    """A quantized layer's weights are buffers: the packing budget counts them,
    so a model whose parameters alone (the embedding, the norms) would fit is
    still too large to pack once per graph, and keeps its streaming one-row products."""
    from specdec.compile import fixed_graphs

    monkeypatch.setenv(ROW_PRODUCTS_ENV, "auto")
    monkeypatch.delenv(fixed_graphs.PACKED_ENV, raising=False)
    target = TargetModel(ModelSpec(str(family_dir(BY_NAME["llama"])), dtype="bfloat16", weights="int8"))
    copies = len(fixed_graphs.WIDTHS) * len(fixed_graphs.PACKAGED_CAPACITIES)
    parameters = sum(p.numel() * p.element_size() for p in target.lm.model.parameters())
    monkeypatch.setattr(fixed_graphs, "PACKED_BUDGET", parameters * copies)      # the parameters alone would fit
    forward = forwards.CompiledForward(target.lm)
    assert not forward.steps.packed and forward.steps.root(1).name.endswith("-rows")


def test_a_long_sum_is_split_into_chunks_inductor_sums_without_its_cascade_helper():
    assert row_products.chunks(576) == 1 and row_products.chunks(4096) == 1
    assert row_products.chunks(4864) == 2 and row_products.chunks(11008) == 4 and row_products.chunks(14336) == 4
    assert row_products.chunks(4099) == 1              # a prime: only 1-element chunks divide it, summed whole
    x = torch.randn(3, 8192)
    torch.testing.assert_close(row_products.chunked_sum(x), x.sum(-1))
    torch.testing.assert_close(row_products.chunked_sum(x.t(), 0), x.sum(-1))


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_a_one_row_product_over_more_than_a_chunk_of_inputs_compiles_to_plain_loops(kind):
    """A product over 8,192 inputs: the compiled loops take no cascade helper
    (a tenth of the speed) and give the layer's own product."""
    from torch._inductor.utils import run_and_get_code

    from specdec.model.quantize import Int8Linear

    torch.manual_seed(5)
    weight = torch.randn(32, 2 * row_products.CHUNK) / 64
    layer = torch.nn.Linear(weight.shape[1], 32, bias=False).bfloat16() if kind == "bf16" else Int8Linear(weight)
    if kind == "bf16":
        layer.weight.data.copy_(weight)
    row_products.install(torch.nn.ModuleList([layer]))
    x = torch.randn(1, weight.shape[1]).bfloat16()
    with torch.no_grad():
        got, code = run_and_get_code(torch.compile(layer, dynamic=False), x)
        want = layer(x)                                    # eagerly: the BLAS product / the int8 kernel
    assert "cascade_sum" not in "".join(code) and "for(" in "".join(code)
    assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_one_row_attention_over_more_than_a_chunk_of_slots_compiles_to_plain_loops():
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(6)
    layer = _Attention()
    row_products.install(torch.nn.ModuleList([layer, torch.nn.Linear(8, 8).bfloat16()]))
    slots = 2 * row_products.CHUNK
    q, k, v = torch.randn(1, 9, 1, 64), torch.randn(1, 3, slots, 64), torch.randn(1, 3, slots, 64)
    mask = torch.ones(1, 1, 1, slots, dtype=torch.bool)
    mask[..., slots - 100:] = False
    got, code = run_and_get_code(
        torch.compile(lambda *a: row_products.one_row_attention(layer, *a, scaling=0.125)[0], dynamic=False),
        q, k, v, mask)
    want = attention.sdpa_forward(layer, q, k, v, mask, scaling=0.125)[0]
    assert "cascade_sum" not in "".join(code)
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
