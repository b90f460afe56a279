import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def family_root(tmp_path_factory, tiny_family):
    """Where the families' tiny models are saved (each with the test tokenizer beside it)."""
    return tmp_path_factory.mktemp("families"), tiny_family["tokenizer"]


@pytest.fixture(scope="session")
def family_dir(family_root):
    """family -> the directory of its saved tiny model (built once per session)."""
    from families import save_model

    root, tokenizer = family_root
    return lambda family, seed=0: save_model(family, root, tokenizer, seed)
