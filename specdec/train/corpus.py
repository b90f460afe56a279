"""Training corpus: the Python standard library of the running interpreter.

Every machine with CPython has it, offline. The corpus is every ``*.py`` file
under ``sysconfig.get_paths()["stdlib"]`` except ``site-packages`` (third-party
code that differs between machines). Files are split into train / held-out by
a hash of their path relative to the stdlib root, so the split is the same on
every machine with the same Python version and does not depend on directory
listing order: a file is held out when ``sha1(relpath) % 20 == 0`` (~5%).
The bundled demo models were trained on CPython 3.11.7's standard library.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELDOUT_MODULUS = 20


@dataclass(frozen=True)
class CorpusSplit:
    root: Path
    train: tuple[Path, ...]
    heldout: tuple[Path, ...]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    digest = hashlib.sha1(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_MODULUS == 0


def stdlib_split(root: Path | None = None) -> CorpusSplit:
    """All stdlib ``.py`` files, sorted by relative path, split by hash."""
    root = root or stdlib_root()
    files = sorted(
        p for p in root.rglob("*.py")
        if "site-packages" not in p.relative_to(root).parts and p.is_file()
    )
    train, heldout = [], []
    for path in files:
        (heldout if is_heldout(path.relative_to(root).as_posix()) else train).append(path)
    return CorpusSplit(root=root, train=tuple(train), heldout=tuple(heldout))


def read_texts(paths: tuple[Path, ...] | list[Path]) -> list[str]:
    """Read source files as UTF-8; undecodable bytes are replaced, not dropped."""
    return [Path(p).read_text(encoding="utf-8", errors="replace") for p in paths]
