"""A tiny family with a 6-layer target and random-weight EAGLE-3 heads beside it."""

import pytest
import torch
from transformers import AutoConfig

from drafter.eagle.eagle3_head import save_head
from eagle3_family import TARGET_LAYERS, random_head3
from tiny import build_family, tiny_llama


@pytest.fixture(scope="session")
def family3(tmp_path_factory):
    """Paths: tokenizer, target (6 layers), eagle3 (reference layout, reduced
    vocabulary), eagle3-full (full vocabulary), eagle (an EAGLE-2 head)."""
    root = tmp_path_factory.mktemp("family3")
    paths = build_family(root)
    target = tiny_llama(AutoConfig.from_pretrained(paths["target"]).vocab_size, 0, layers=TARGET_LAYERS)
    target.save_pretrained(paths["target"])
    paths["eagle3"] = root / "eagle3"
    paths["eagle3-full"] = root / "eagle3-full"
    save_head(random_head3(paths["target"]), paths["eagle3"], dtype=torch.float32)
    save_head(random_head3(paths["target"], draft_vocab=None, seed=6), paths["eagle3-full"], dtype=torch.float32)
    return paths
