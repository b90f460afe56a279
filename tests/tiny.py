"""Tiny random-weight model families for tests, built on the fly (nothing is downloaded).

A family is a directory tree like the bundled demo: tokenizer, target, eagle
(EAGLE layout), draft-lm. Weights are random but sharp enough (larger init)
that greedy decoding has no near-ties.
"""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
] * 20


def tiny_config(vocab_size: int, hidden: int = 48, layers: int = 2, seed: int = 0, max_positions: int = 512):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                       max_position_embeddings=max_positions, initializer_range=0.15,
                       tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)


def tiny_llama(vocab_size: int, seed: int, **kw):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(vocab_size, **kw)).eval()
    return model


def build_family(root: Path, seed: int = 0, vocab_size: int = 300) -> dict[str, Path]:
    from drafter.eagle.eagle2_head import EagleHead, head_config, save_head
    from specdec.train.tokenizer import train_tokenizer

    paths = {name: root / name for name in ("tokenizer", "target", "eagle", "draft-lm")}
    train_tokenizer(CORPUS, paths["tokenizer"], vocab_size=vocab_size)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(paths["tokenizer"])
    v = len(tok)
    target = tiny_llama(v, seed)
    target.save_pretrained(paths["target"])
    tok.save_pretrained(paths["target"])
    torch.manual_seed(seed + 1)
    head = EagleHead(head_config(target.config.to_dict()))
    save_head(head, paths["eagle"], dtype=torch.float32)
    tiny_llama(v, seed + 2, hidden=32, layers=1).save_pretrained(paths["draft-lm"])
    return paths


def tiny_medusa(target, seed: int, num_heads: int = 3, num_layers: int = 1, scale: float = 3.0):
    """Random Medusa heads for ``target`` (a loaded tiny Llama): blocks random,
    vocabulary projections the target's lm_head plus noise, so the heads'
    guesses are sharp and sometimes right."""
    from drafter.medusa_heads import MedusaHeads

    torch.manual_seed(seed)
    cfg = target.config
    heads = MedusaHeads(cfg.hidden_size, cfg.vocab_size, num_heads, num_layers)
    with torch.no_grad():
        for lm in heads.lm_heads:
            lm.weight.copy_(target.lm_head.weight + 0.1 * scale * torch.randn_like(lm.weight))
    return heads.eval()


def tiny_hydra(target, seed: int, num_heads: int = 3, num_layers: int = 1, scale: float = 3.0,
               path_scale: float = 1.0, prefix: bool = False):
    """Random Hydra heads for ``target`` (a loaded tiny Llama): each first block
    passes the hidden state through and mixes in the path embeddings with
    random weights (``path_scale``: 0 gives heads that ignore the path),
    vocabulary projections the target's lm_head plus noise, so the heads'
    guesses are sharp, path-dependent and sometimes right. ``prefix``: Hydra++
    (prefix-mlp) heads, their prefix layer random, its attention and MLP
    outputs halved (the hidden state stays the larger part of what it passes on)."""
    from drafter.hydra_heads import HydraHeads
    from drafter.hydra_prefix import prefix_config

    torch.manual_seed(seed)
    cfg = target.config
    h = cfg.hidden_size
    heads = HydraHeads(h, cfg.vocab_size, num_heads, num_layers, prefix_config(cfg) if prefix else None)
    with torch.no_grad():
        if prefix:
            layer = heads.prefix.layers[0]
            layer.self_attn.o_proj.weight.mul_(0.5)
            layer.mlp.down_proj.weight.mul_(0.5)
        for i, mlp in enumerate(heads.hydra_mlp):
            first = mlp[0]
            first.res_connection.weight.copy_(torch.cat(
                [torch.eye(h), path_scale * torch.randn(h, h * (i + 1)) / 0.15 / (h * (i + 1)) ** 0.5], dim=1))
            first.linear.weight.mul_(path_scale)
        for lm in heads.hydra_lm_head:
            lm.weight.copy_(target.lm_head.weight + 0.1 * scale * torch.randn_like(lm.weight))
    return heads.eval()


def save_tiny_heads(target_dir, root, medusa_layout: str = "original") -> dict:
    """``tiny_medusa`` and ``tiny_hydra`` heads (mlp, and prefix-mlp as kind
    "hydra-prefix") for the model in ``target_dir``, saved under ``root``;
    their directories by kind."""
    from transformers import AutoModelForCausalLM

    from drafter.hydra_heads import save_heads as save_hydra
    from drafter.medusa_heads import save_heads as save_medusa

    target = AutoModelForCausalLM.from_pretrained(target_dir)
    save_medusa(tiny_medusa(target, seed=4, num_heads=3), root / "medusa", medusa_layout)
    save_hydra(tiny_hydra(target, seed=5), root / "hydra")
    save_hydra(tiny_hydra(target, seed=5, prefix=True), root / "hydra-prefix")
    return {"medusa": root / "medusa", "hydra": root / "hydra", "hydra-prefix": root / "hydra-prefix"}
