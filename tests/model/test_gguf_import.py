"""GGUF files as models: ``--target``/``--draft-lm`` take a GGUF file, converted
once into the model cache and served as that directory. Checked against the
exporter's files of the tiny family (f32: the very weights; Q8_0 and Q4_1:
the gguf package's own dequantization), greedy output against plain greedy
decoding of the same weights, the cache reused without reading the file
again, and one-line refusals for files that cannot be served."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from specdec.cli.main import main
from specdec.model import gguf_import
from specdec.model.gguf_export import export_llama
from specdec.model.gguf_import import GgufError, check, converted_dir, model_path

PROMPTS = ["def add(a, b):", "for i in range(3):", "import os"]


@pytest.fixture(autouse=True)
def model_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(gguf_import.CACHE_ENV, str(tmp_path / "models"))


@pytest.fixture(scope="module")
def gguf_files(tiny_family, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {quant or "F32": export_llama(tiny_family["target"], root / f"target-{quant or 'f32'}.gguf", quant=quant)
            for quant in (None, "Q8_0", "Q4_1")}


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _greedy_cli(capsys, target, *flags):
    code = main(["generate", "--local", "--json", "--max-new-tokens", "20", "--target", str(target), *flags,
                 *PROMPTS[:1]])
    out, err = capsys.readouterr()
    assert code == 0, err
    return [json.loads(line)["token_ids"] for line in out.splitlines()]


def test_f32_file_is_the_very_model(gguf_files, tiny_family):
    """The exporter reorders rotary rows for llama.cpp; the conversion undoes it: same logits."""
    directory = model_path(gguf_files["F32"])
    assert directory == converted_dir(gguf_files["F32"]) and (directory / "config.json").is_file()
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        want = _hf_model(tiny_family["target"])(ids).logits
        got = _hf_model(directory)(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    from transformers import AutoTokenizer

    ref, tok = AutoTokenizer.from_pretrained(tiny_family["target"]), AutoTokenizer.from_pretrained(directory)
    for text in PROMPTS:
        assert tok(text)["input_ids"] == ref(text)["input_ids"]


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_1"])
def test_quantized_weights_are_the_gguf_packages_dequantization(gguf_files, quant):
    reader = gguf.GGUFReader(gguf_files[quant])
    down = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert down.tensor_type == gguf.GGMLQuantizationType[quant]
    want = gguf.quants.dequantize(np.asarray(down.data), down.tensor_type)
    got = _hf_model(model_path(gguf_files[quant])).model.layers[0].mlp.down_proj.weight.detach().numpy()
    assert np.array_equal(got, want)


@pytest.mark.parametrize("quant", ["F32", "Q4_1"])
def test_speculation_on_a_gguf_target_is_greedy_identical(gguf_files, tiny_family, capsys, quant):
    """Lossless on the file's weights: n-gram and EAGLE speculation (the head reads the
    converted directory's embeddings) equal plain decoding, and that equals
    transformers' greedy ``generate`` of the converted directory."""
    path = gguf_files[quant]
    plain = _greedy_cli(capsys, path, "--method", "vanilla")
    assert _greedy_cli(capsys, path, "--ngram", "--method", "eagle2") == plain
    assert _greedy_cli(capsys, path, "--eagle", str(tiny_family["eagle"]), "--method", "eagle2") == plain
    from transformers import AutoTokenizer

    directory = converted_dir(path)
    tok = AutoTokenizer.from_pretrained(directory)
    ids = torch.tensor([tok(PROMPTS[0])["input_ids"]])
    with torch.no_grad():
        out = _hf_model(directory).generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None,
                                            pad_token_id=0)
    assert plain[0] == out[0, ids.shape[1]:].tolist()[:len(plain[0])]


def test_a_second_start_reuses_the_conversion(gguf_files, monkeypatch):
    first = model_path(gguf_files["Q8_0"])
    stamp = (first / "model.safetensors").stat().st_mtime_ns

    def refuse(*_):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_import, "convert", refuse)
    assert model_path(gguf_files["Q8_0"]) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_replaced_file_is_converted_anew(gguf_files, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(gguf_files["F32"].read_bytes())
    first = model_path(path)
    path.write_bytes(gguf_files["Q8_0"].read_bytes())
    assert model_path(path) != first


def _rewrite_arch(src, dst, arch):
    """``src`` with its architecture key renamed (the tensors are not read)."""
    data = src.read_bytes()
    old = b"general.architecture"
    at = data.index(old) + len(old) + 4 + 8         # key, value type, string length
    assert data[at:at + 5] == b"llama"
    dst.write_bytes(data[:at - 8] + len(arch).to_bytes(8, "little") + arch.encode() + data[at + 5:])


@pytest.mark.parametrize("damage,needle", [
    ("half", "truncated"),
    ("header", "cannot be read"),
    ("arch", "architecture 'nosuchlm' cannot be loaded"),
])
def test_files_that_cannot_be_served_are_one_line(gguf_files, tmp_path, capsys, damage, needle):
    src, bad = gguf_files["F32"], tmp_path / "bad.gguf"
    data = src.read_bytes()
    if damage == "half":
        bad.write_bytes(data[:len(data) // 2])
    elif damage == "header":
        bad.write_bytes(data[:200])
    else:
        _rewrite_arch(src, bad, "nosuchlm")
    with pytest.raises(GgufError, match=needle):
        check(bad)
    code = main(["generate", "--local", "--target", str(bad), "--method", "vanilla", "hi"])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "bad.gguf" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not converted_dir(bad).exists()


def test_an_unsupported_tensor_type_is_named(gguf_files, tmp_path, monkeypatch):
    """A type the gguf package cannot dequantize (here: Q8_0 made to fail) is refused by name."""
    real = gguf.quants.dequantize

    def no_q8(data, qtype):
        if qtype == gguf.GGMLQuantizationType.Q8_0:
            raise NotImplementedError("no Q8_0 here")
        return real(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", no_q8)
    with pytest.raises(GgufError, match=r"tensor type Q8_0 \(in blk\.0\.ffn_down\.weight\)"):
        check(gguf_files["Q8_0"])


def test_a_file_that_is_not_a_model_is_one_line(tmp_path, capsys):
    junk = tmp_path / "weights.bin"
    junk.write_bytes(b"not a model")
    code = main(["generate", "--local", "--target", str(junk), "--method", "vanilla", "hi"])
    err = capsys.readouterr().err
    assert code == 2 and "neither a model directory nor a GGUF file" in err


def test_the_orchestrator_finds_the_verifiers_conversion(gguf_files):
    """The orchestrator loads no weights: ``--tokenizer FILE.gguf`` names the converted
    directory once a verifier has converted it, and says what to do before."""
    from specdec.cli.stack import tokenizer_location
    from specdec.request.errors import UsageError

    with pytest.raises(UsageError, match="not converted yet: start a verifier with --target"):
        tokenizer_location(str(gguf_files["F32"]))
    directory = model_path(gguf_files["F32"])
    assert tokenizer_location(str(gguf_files["F32"])) == directory
