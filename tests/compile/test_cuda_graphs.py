"""What ``specdec.compile.cuda_graphs`` decides without a GPU: which devices replay
compiled steps as CUDA graphs, the variable that turns them off, and which
argument of each compiled step is the K/V buffer a graph is recorded for.
The recordings themselves run in ``tests/compile/test_compiled_cuda.py``
(``pytest -m cuda``, on a GPU)."""

import pytest
import torch

from specdec.compile import cuda_graphs
from specdec.compile.fixed_step import FixedStep
from drafter.compiled.head_levels import HeadStep


def test_graphs_are_for_cuda_devices_unless_turned_off(monkeypatch):
    monkeypatch.delenv("SPECDEC_CUDA_GRAPHS", raising=False)
    assert cuda_graphs.enabled(torch.device("cuda", 0)) and cuda_graphs.enabled(torch.device("cuda"))
    assert not cuda_graphs.enabled(torch.device("cpu"))
    monkeypatch.setenv("SPECDEC_CUDA_GRAPHS", "off")
    assert not cuda_graphs.enabled(torch.device("cuda", 0))
    monkeypatch.setenv("SPECDEC_CUDA_GRAPHS", "maybe")
    with pytest.raises(ValueError, match="SPECDEC_CUDA_GRAPHS must be one of on, off, got 'maybe'"):
        cuda_graphs.enabled(torch.device("cuda", 0))


def test_a_graph_is_recorded_per_buffer_the_step_writes():
    assert cuda_graphs.cache_argument(FixedStep) == 4       # (tokens, positions, mask, slots, stack, layers)
    assert cuda_graphs.cache_argument(HeadStep) == 5        # (tokens, parent, positions, mask, slots, stack)
