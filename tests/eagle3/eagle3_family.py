"""Random-weight EAGLE-3 heads for the tiny families of these tests."""

import json

import torch
from transformers import AutoConfig

from drafter.eagle import eagle3_layouts as layouts
from drafter.eagle.eagle3 import Eagle3Drafter
from drafter.eagle.eagle3_head import Eagle3Head, head3_config, head3_config_for, save_head
from serving.helpers import start_drafter

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


def read_config(directory) -> dict:
    return json.loads((directory / "config.json").read_text())


async def start_eagle3_drafter(paths, head: str = "eagle3", **cfg):
    """A drafter service over the EAGLE-3 head ``paths[head]`` (``cfg``: its config, e.g. a batch window)."""
    server, servicer = await start_drafter(paths, "eagle", warm=False, metrics_port=None, **cfg)
    await servicer.load(lambda: Eagle3Drafter(paths[head], paths["target"], max_sessions=8))
    server.set_ready(True)
    return server, servicer


def add_eagle3_drafter(stack, name: str, head: str = "eagle3", **cfg):
    stack.servers[name] = stack.loop.run(start_eagle3_drafter(stack.paths, head, **cfg))
