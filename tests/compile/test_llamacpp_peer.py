"""The llama.cpp peer of ``specdec bench``: skipped with one clear line when
llama-cpp-python is missing, and (when installed) llama.cpp's greedy tokens on
the exported demo target equal specdec vanilla's, which proves the export."""

from __future__ import annotations

import json

import pytest

from specdec.bench import llamacpp_peer
from specdec.bench.llamacpp_peer import MISSING, identical_fraction, llamacpp_methods
from specdec.cli.main import main
from specdec.model.gguf_export import FILE_TYPES
from specdec.model.loading import demo_path

PROMPTS = ["def fibonacci(n):\n    ", "class Stack:\n    def __init__(self):\n        ",
           "import os\n\ndef list_files(path):\n    "]


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS))
    return path


def test_no_llamacpp_method_asked_for_means_no_note():
    assert llamacpp_methods(["vanilla", "eagle2"], "unused", None, 8, 0.0, frozenset(), 64, 1) == ({}, [])


def test_skipped_with_one_clear_line_when_missing(tiny_family, prompt_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(llamacpp_peer, "llama_cpp", None)
    out = tmp_path / "r.json"
    args = ["bench", "--target", str(tiny_family["target"]), "--prompts", str(prompt_file), "--limit-prompts", "1",
            "--max-new-tokens", "4", "--methods", "vanilla,llamacpp,llamacpp-lookup,llamacpp-gguf", "--json",
            str(out)]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert err.count("llama-cpp-python is not installed") == 1, err
    result = json.loads(out.read_text())
    assert set(result["methods"]) == {"vanilla", "hf-generate"}
    assert result["llamacpp"]["notes"] == [MISSING]


def test_each_method_decodes_its_file(tiny_family, tmp_path, monkeypatch):
    """llamacpp / llamacpp-lookup: the f32 export of the served weights;
    llamacpp-q8: their Q8_0 export; llamacpp-gguf: the GGUF file the target
    was converted from, or a note."""
    from specdec.model import gguf_import
    from specdec.model.gguf_export import export_llama

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv(gguf_import.CACHE_ENV, str(tmp_path / "models"))
    q8 = export_llama(tiny_family["target"], tmp_path / "tiny.Q8_0.gguf", quant="Q8_0")
    converted = gguf_import.model_path(q8)
    files, notes = llamacpp_peer.gguf_files(["llamacpp", "llamacpp-gguf"], str(converted), None)
    assert files["llamacpp-gguf"] == q8 and files["llamacpp"].name.endswith("-f32.gguf") and notes == []
    assert files["llamacpp"].parent == tmp_path / "cache" / "specdec" / "gguf"
    files, notes = llamacpp_peer.gguf_files(["llamacpp-q8", "llamacpp-lookup"], str(tiny_family["target"]), None)
    assert notes == [] and files["llamacpp-lookup"].name.endswith("-f32.gguf")
    assert files["llamacpp-q8"].name.endswith("-q8_0.gguf") and file_type(files["llamacpp-q8"]) == FILE_TYPES["Q8_0"]
    files, notes = llamacpp_peer.gguf_files(["llamacpp-gguf"], str(tiny_family["target"]), None)
    assert files == {} and notes == ["llamacpp-gguf skipped: the target was not given as a GGUF file"]
    assert not list((tmp_path / "cache" / "specdec" / "gguf").glob("target-*-q4*"))   # nothing exported for it


def file_type(path) -> int:
    import gguf

    field = gguf.GGUFReader(str(path)).fields["general.file_type"]
    return int(field.parts[field.data[0]][0])


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_exports_hold_the_directorys_weights_whatever_the_run_loaded(tiny_family, tmp_path, monkeypatch, weights):
    """A run at --dtype bfloat16 or --weights int8 hands llama.cpp the
    directory's float32 weights, not its own rounded copy; a float32 load is
    exported as it is (no second read of the directory)."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    from specdec.model.quantize import quantize_linears

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = AutoModelForCausalLM.from_pretrained(tiny_family["target"], dtype=torch.float32)
    table = model.model.embed_tokens.weight.detach().clone()
    assert llamacpp_peer.holds_float32_weights(model)
    if weights == "bfloat16":
        model = model.to(torch.bfloat16)
    else:
        quantize_linears(model, "int8")
    assert not llamacpp_peer.holds_float32_weights(model)
    files, notes = llamacpp_peer.gguf_files(["llamacpp"], str(tiny_family["target"]), model)
    tensor = next(t for t in gguf.GGUFReader(str(files["llamacpp"])).tensors if t.name == "token_embd.weight")
    assert notes == [] and torch.equal(torch.from_numpy(tensor.data.copy()).reshape(table.shape), table)


def test_identical_fraction():
    ref = {(0, 0): [1, 2], (0, 1): [3, 4]}
    assert identical_fraction({(0, 0): [1, 2], (0, 1): [3, 5]}, ref) == 0.5
    assert identical_fraction(ref, ref) == 1.0
    assert identical_fraction({}, {}) is None


@pytest.mark.slow          # needs the llamacpp extra (a from-source llama.cpp build): run by `make bench`
@pytest.mark.skipif(not llamacpp_peer.available(), reason="llama-cpp-python (specdec[llamacpp]) is not installed")
def test_llamacpp_greedy_equals_vanilla_on_the_demo_target(prompt_file, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "r.json"
    args = ["bench", "--target", str(demo_path("target")), "--prompts", str(prompt_file), "--max-new-tokens", "32",
            "--methods", "vanilla,llamacpp,llamacpp-lookup", "--quiet", "--json", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["llamacpp"]["identical_to_vanilla"] == {"llamacpp": 1.0, "llamacpp-lookup": 1.0}
    assert result["methods"]["llamacpp"]["matches_vanilla"] is True
    assert result["generated_tokens"]["llamacpp"] == result["generated_tokens"]["vanilla"] == 3 * 32
    assert list((tmp_path / "cache" / "specdec" / "gguf").glob("target-*-f32.gguf"))
