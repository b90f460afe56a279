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
