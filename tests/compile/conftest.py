import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "model"))


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory, tiny_family):
    """family -> the directory of its saved tiny model (the test tokenizer beside it)."""
    from families import save_model

    root = tmp_path_factory.mktemp("families")
    return lambda family, seed=0: save_model(family, root, tiny_family["tokenizer"], seed)


@pytest.fixture
def ahead_all(monkeypatch):
    """Start-up builds every graph it builds for users (``SPECDEC_COMPILE_AHEAD=all``, the
    default; the suite runs with ``ready``: ``tests/conftest.py``)."""
    from specdec.model.loading import AHEAD_ENV

    monkeypatch.setenv(AHEAD_ENV, "all")
