"""Compiled CPU packages are keyed by the thread count they were built at
(``specdec.compile.aot.package_dir``): inductor writes a CPU kernel's parallel
loops for the count torch has while it compiles, so a package built at one
thread and loaded by a start at two would run serially. The directory is
chosen when the graphs are set up: a verifier that changes its count between
requests (``--solo-threads``) keeps loading its start-up count's packages."""

import pytest
import torch
from families import BY_NAME
from torch._inductor import config as inductor_config

from specdec.compile import aot, forwards
from specdec.model.loading import ModelSpec
from verifier.engine import TargetModel

CPU = torch.device("cpu")


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_packages_built_at_more_than_one_thread_live_apart(restore_threads):
    step, model = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    torch.set_num_threads(1)
    one = aot.package_dir(step, model, torch.float32, CPU)
    torch.set_num_threads(2)
    two = aot.package_dir(step, model, torch.float32, CPU)
    with inductor_config.patch({"cpp.threads": 3}):        # inductor's own setting wins over torch's count
        three = aot.package_dir(step, model, torch.float32, CPU, variant="rows")
    assert not one.name.endswith("-t1")                    # as before: packages built at one thread stay valid
    assert two.name == one.name + "-t2" and three.name == one.name + "-rows-t3"
    assert not aot.package_dir(step, model, torch.float32, torch.device("meta")).name.endswith("-t2")   # CPU only


def test_graphs_keep_the_directory_of_the_count_they_were_set_up_at(family_dir, restore_threads):
    target = TargetModel(ModelSpec(str(family_dir(BY_NAME["llama"]))))
    torch.set_num_threads(2)
    forward = forwards.CompiledForward(target.lm, packed=False)
    roots = {w: forward.steps.root(w) for w in (1, 16)}
    assert all(root.name.endswith("-t2") for root in roots.values())
    torch.set_num_threads(1)                               # as --solo-threads switches between requests
    assert {w: forward.steps.root(w) for w in (1, 16)} == roots
    assert not forwards.CompiledForward(target.lm, packed=False).packages.name.endswith("-t2")
