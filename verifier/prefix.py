"""The verifier's prefix cache: a prompt's prefill over the target's K/V and
features of prompt prefixes other sessions already ran
(``specdec.model.prefix_cache``).

A block holds the target's K/V of its tokens (every layer) and the session's
features at them (what an EAGLE drafter's prefill reads: the final hidden
state, or the streams entering the session's feature layers, which are part
of the key). Blocks are copies, taken when a prefill ends: whatever the
session does next (verify, roll back, release) never reaches them, and every
token in them is a prompt token, committed by definition.
"""

from __future__ import annotations

import torch

from specdec.model import kv
from specdec.model import prefix_cache as pc


class TargetPrefixCache:
    """Prefix blocks of one ``verifier.target.TargetModel``."""

    def __init__(self, target, max_tokens: int, exact: bool = False, block: int | None = None):
        self.target = target
        self.blocks = pc.PrefixCache(max_tokens, block, exact)
        spec = target.spec
        # the model's identity (each engine keeps its own blocks; the key names the model all the same)
        self.model = (str(spec.path), str(spec.dtype), spec.weights, target.num_layers, target.vocab_size)

    @property
    def on(self) -> bool:
        return self.blocks.on

    def keys(self, tokens: list[int], feature_layers: tuple[int, ...], salt: str) -> list[bytes]:
        root = pc.namespace("target", *self.model, tuple(feature_layers), salt, self.blocks.block)
        return pc.token_keys(root, tokens, self.blocks.block)

    @torch.inference_mode()
    def prefill(self, cache, tokens: list[int], feature_layers: tuple[int, ...], salt: str,
                lookup: bool = True, all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``tokens`` into the empty ``cache`` (``PrefixCache.spans``), the
        longest cached prefix loaded instead of computed (``lookup``); then the
        whole blocks not cached yet are added. Returns the features of every
        token [n, F] and the logits [m, V] of the last m tokens run (every
        run token's with ``all_logits``, else the last one's)."""
        block = self.blocks.block
        keys = self.keys(tokens, feature_layers, salt)
        found = self.blocks.match(keys, pc.usable(len(tokens), block)) if lookup else []
        start = len(found) * block
        if found:
            self.target.fit(cache, start)
            kv.append_blocks(cache, [slots for slots, _ in found])
        feats = [f for _, f in found]
        logits = []
        ids = torch.tensor(tokens, dtype=torch.long)
        for a, b in self.blocks.spans(start, len(tokens)):
            hidden, out = self.target.forward(cache, ids[a:b], torch.arange(a, b), None, feature_layers,
                                              last_logits=not all_logits)
            feats.append(hidden)
            logits.append(out)
        features = torch.cat(feats)
        self.blocks.insert(keys, lambda j: self._block(cache, features, j))
        return features, torch.cat(logits) if all_logits else logits[-1]

    def _block(self, cache, features: torch.Tensor, j: int) -> tuple[tuple, int]:
        a, b = j * self.blocks.block, (j + 1) * self.blocks.block
        slots, feats = kv.copy_slots(cache, a, b), features[a:b].clone()
        return (slots, feats), kv.slots_nbytes(slots) + feats.numel() * feats.element_size()
