import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
torch.set_num_threads(int(os.environ.get("SPECDEC_TEST_THREADS", "1")))
# compiled graphs over the models' own weights: a tiny model's packed packages take ~3x as long to
# build on an empty compile cache; the packed path has its own tests (``tests/compile/test_compiled.py``)
os.environ.setdefault("SPECDEC_COMPILE_PACKED", "off")
# only the graphs opened before readiness are built at start-up, any other on first use: most tests run
# a few widths of many models, and on an empty cache each package costs seconds to build (the tests of
# start-up building set ``all``, the default, themselves)
os.environ.setdefault("SPECDEC_COMPILE_AHEAD", "ready")


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    from tiny import build_family

    return build_family(tmp_path_factory.mktemp("family"))
