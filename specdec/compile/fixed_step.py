"""The fixed-shape forward every compiled target graph runs (``specdec.compile.forwards``).

Its own module because a package's key digests the source it was traced from
(``specdec.compile.aot.code_fingerprint``): this class and the K/V writes of
``specdec.compile.fixed_kv``, not the Python around the graphs (padding, buckets,
warming), whose edits then keep the packages on disk."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from specdec.compile.fixed_kv import FixedLayer
from specdec.model import kv
from specdec.model.causal_lm import CausalLm


class FixedStep(torch.nn.Module):
    """A causal LM over one stacked cache buffer [layers, 2, 1, heads, C, d]
    (K at [:, 0], V at [:, 1]); with ``captures``, also the residual streams
    entering that many layers."""

    def __init__(self, lm: CausalLm, captures: int = 0):
        super().__init__()
        self.model = lm.model              # registered, so export and the packages see its weights by name
        self.lm = lm
        self.captures = captures
        self.cache_keyword = kv.cache_keyword(type(lm.body).forward)     # looked up outside the traced forward

    def forward(self, tokens, positions, mask, slots, stack, layers=None):
        """tokens, positions [1, nb]; mask [1, 1, nb, C] (or per layer type);
        slots [nb]; stack as above, the nb new slots written in place; layers
        [captures] HF hidden-state indices (with captures). Returns (features
        [1, nb, H] fp32, logits [1, nb, V]), with captures (features, the
        streams entering ``layers`` [1, nb, captures * H] fp32, logits)."""
        cache = Cache(layers=[FixedLayer(stack, i, slots) for i in range(stack.shape[0])])
        out = self.lm.body(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True,
                           output_hidden_states=self.captures > 0, **{self.cache_keyword: cache})
        hidden = out.last_hidden_state
        if not self.captures:
            return hidden.float(), self.lm.logits(hidden)
        streams = torch.stack(out.hidden_states[:stack.shape[0]]).index_select(0, layers)   # [k, 1, nb, H]
        return hidden.float(), streams.permute(1, 2, 0, 3).flatten(2).float(), self.lm.logits(hidden)
