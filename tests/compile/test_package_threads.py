"""A compiled package is keyed by the thread count it was built at
(``specdec.compile.aot.package_path``): inductor writes a CPU kernel's parallel
loops for the count torch has while it compiles, so a package built at one
thread and loaded by a start at two would run serially."""

import pytest
import torch
from torch._inductor import config as inductor_config

from specdec.compile import aot


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_packages_built_at_more_than_one_thread_carry_their_count(tmp_path, restore_threads):
    torch.set_num_threads(1)
    one = aot.package_path(tmp_path, 1, 256, packed=False)
    batched = aot.package_path(tmp_path, 4, 512, packed=True, batched=True)
    torch.set_num_threads(2)
    two = aot.package_path(tmp_path, 1, 256, packed=False)
    with inductor_config.patch({"cpp.threads": 3}):        # inductor's own setting wins over torch's count
        three = aot.package_path(tmp_path, 1, 256, packed=False)
    assert one.name == "step-w1-c256-shared.pt2"           # as before: packages built at one thread stay valid
    assert batched.name == "step-w4-c512-batch-packed.pt2"
    assert two.name == "step-w1-c256-t2-shared.pt2" and three.name == "step-w1-c256-t3-shared.pt2"
    assert len({one, two, three}) == 3 and {p.parent for p in (one, two, three)} == {tmp_path}
