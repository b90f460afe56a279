"""The memory floor of a one-token step (``specdec.bench.roofline``): the
bytes a step streams count each weight once — a tied head once, an untied
input embedding not at all, a quantized layer as stored — and the floor is
those bytes at the measured bandwidth; ``bench profile`` reports it."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.bench import roofline
from specdec.cli.main import main
from specdec.model.quantize import quantize_linears


def _llama(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(config).eval()


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("tied", [True, False])
def test_a_step_streams_every_weight_once_and_the_embedding_only_as_the_head(tied):
    model = _llama(tied)
    everything = _bytes({t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}.values())
    table = _bytes([model.model.embed_tokens.weight])
    assert roofline.weight_bytes(model) == (everything if tied else everything - table)
    decoder = sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.layers") or "norm" in n)
    assert roofline.matmul_parameters(model) == decoder + 320 * 64       # the head, once either way


def test_an_int8_model_streams_its_int8_weights():
    model = _llama(tied=True)
    params = roofline.matmul_parameters(model)
    quantize_linears(model, "int8")
    # every linear's weight now one byte an element (plus a bf16 scale per output), the tied table kept for the lookup
    linears = sum(m.qweight.numel() + 2 * m.scales.numel() for m in model.modules() if hasattr(m, "qweight"))
    rest = _bytes(p for n, p in model.named_parameters() if "embed_tokens" not in n)
    buffers = _bytes(b for n, b in model.named_buffers() if not n.endswith(("qweight", "scales")))
    assert roofline.weight_bytes(model) == linears + rest + buffers
    assert roofline.matmul_parameters(model) == params


def test_the_floor_is_the_bytes_at_the_bandwidth():
    model = _llama(tied=True)
    record = roofline.roofline(model, {"eager": 4.0, "compiled": 2.0}, bandwidth=10.0)
    floor = roofline.weight_bytes(model) / 10e9 * 1e3
    assert record["floor_ms"] == pytest.approx(floor, abs=1e-3)
    assert record["steps"]["compiled"]["of_floor"] == pytest.approx(floor / 2.0, abs=1e-3)
    params = roofline.matmul_parameters(model)
    assert record["floor_tokens_per_s"]["float32"] == pytest.approx(10e9 / (4 * params), rel=1e-3)
    assert record["floor_tokens_per_s"]["bfloat16"] == pytest.approx(2 * record["floor_tokens_per_s"]["float32"],
                                                                     rel=1e-3)
    assert roofline.stream_bandwidth(torch.device("cpu"), runs=2) > 0.1
    assert any("floor ÷ step" in line for line in roofline.markdown(record))


def test_the_profile_reports_the_floor(tiny_family, tmp_path, capsys):
    out = tmp_path / "prof.json"
    assert main(["bench", "profile", "--target", str(tiny_family["target"]), "--threads", "1", "--steps", "2",
                 "--prefix", "8", "--json", str(out)]) == 0
    record = json.loads(out.read_text())["roofline"]
    assert record["weight_bytes"] > 0 and record["stream_gb_s"] > 0
    assert set(record["steps"]) == {"eager"} and 0 < record["steps"]["eager"]["of_floor"]
    assert "Memory floor of a one-token step" in capsys.readouterr().out
