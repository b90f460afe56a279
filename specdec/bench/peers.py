"""External peers: transformers' own ``generate`` on the same target model.

- ``hf-generate``: plain decoding (greedy or sampling, KV cache on), the
  baseline users know;
- ``hf-assisted``: assisted generation with the small draft LM as
  ``assistant_model`` (a chain of draft tokens per step, HF's default
  number-of-assistant-tokens schedule);
- ``hf-prompt-lookup``: prompt lookup decoding (``prompt_lookup_num_tokens``):
  drafts copied from the context, no model.

They share the target's weights with the in-process methods (one model object
in memory). HF does not expose its draft/verify cycles, so these report
tokens/s and output only; tau and the time split are null for them.
"""

from __future__ import annotations

import copy
import time

import torch

from specdec.bench.runner import Prompt, Sample

PEERS = ("hf-generate", "hf-assisted", "hf-prompt-lookup")
PROMPT_LOOKUP_TOKENS = 10


class HfPeer:
    def __init__(self, kind: str, model, max_new_tokens: int, temperature: float,
                 eos_ids: frozenset[int], assistant=None, prompt_lookup_tokens: int = PROMPT_LOOKUP_TOKENS):
        if kind not in PEERS:
            raise ValueError(f"unknown peer {kind!r}; expected one of {', '.join(PEERS)}")
        if kind == "hf-assisted" and assistant is None:
            raise ValueError("hf-assisted needs the draft LM as assistant model")
        self.kind = kind
        self.model = model
        self.temperature = temperature
        config = copy.deepcopy(model.generation_config)
        # The same stop rule as the in-process loop: EOS and max_new_tokens only.
        eos = sorted(eos_ids)
        config.eos_token_id = eos or None
        if config.pad_token_id is None:
            config.pad_token_id = eos[0] if eos else 0
        config.max_new_tokens = max_new_tokens
        config.use_cache = True
        if temperature > 0:
            # top_k / top_p off, as in the project's own sampling at these params
            config.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            config.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        self.config = config
        self.extra: dict = {}
        if kind == "hf-assisted":
            self.extra["assistant_model"] = assistant
        elif kind == "hf-prompt-lookup":
            self.extra["prompt_lookup_num_tokens"] = prompt_lookup_tokens

    @torch.inference_mode()
    def run(self, prompt: Prompt, seed: int | None) -> Sample:
        ids = torch.tensor([prompt.ids], dtype=torch.long, device=self.model.device)  # [1, P]
        if seed is not None:
            torch.manual_seed(seed)
        t = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=self.config,
                                  **self.extra)
        wall = time.perf_counter() - t
        return Sample(tokens=out[0, ids.shape[1]:].tolist(), wall_s=wall)
