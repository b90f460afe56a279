"""A tiny family with a 6-layer target and random-weight EAGLE-3 heads beside it."""

import json

import pytest
import torch
from transformers import AutoConfig

from drafter.eagle3_head import Eagle3Head, head3_config, head3_config_for, save_head
from drafter import eagle3_layouts as layouts

TARGET_LAYERS = 6
DRAFT_VOCAB = 64


def random_head3(target_dir, draft_vocab: int | None = DRAFT_VOCAB, seed: int = 5, layers=None) -> Eagle3Head:
    """A random EAGLE-3 head for the target in ``target_dir``; its draft vocabulary is
    every third target id (so d2t offsets are non-trivial)."""
    config = head3_config_for(AutoConfig.from_pretrained(target_dir), draft_vocab_size=draft_vocab, layers=layers)
    torch.manual_seed(seed)
    head = Eagle3Head(head3_config(layouts.llama_fields(config)), layouts.feature_layers(config, None))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.15)
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
    vocab = head.t2d.numel()
    head.set_draft_vocab(torch.arange(0, vocab, max(1, vocab // head.draft_vocab_size))[:head.draft_vocab_size])
    return head.eval()


@pytest.fixture(scope="session")
def family3(tmp_path_factory):
    """Paths: tokenizer, target (6 layers), eagle3 (reference layout, reduced
    vocabulary), eagle3-full (full vocabulary), eagle (an EAGLE-2 head)."""
    from tiny import build_family, tiny_llama

    root = tmp_path_factory.mktemp("family3")
    paths = build_family(root)
    target = tiny_llama(AutoConfig.from_pretrained(paths["target"]).vocab_size, 0, layers=TARGET_LAYERS)
    target.save_pretrained(paths["target"])
    paths["eagle3"] = root / "eagle3"
    paths["eagle3-full"] = root / "eagle3-full"
    save_head(random_head3(paths["target"]), paths["eagle3"], dtype=torch.float32)
    save_head(random_head3(paths["target"], draft_vocab=None, seed=6), paths["eagle3-full"], dtype=torch.float32)
    return paths


def read_config(directory) -> dict:
    return json.loads((directory / "config.json").read_text())
