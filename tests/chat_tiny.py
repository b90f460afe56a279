"""Tiny random chat targets for tests: the tiny family's tokenizer with a chat
template's special tokens added, and a random Llama over that vocabulary.

Two template styles: ChatML (``<|im_start|>user\\n...<|im_end|>\\n``, as
SmolLM2 and Qwen write it) and Llama 3 (``<|start_header_id|>user<|end_header_id|>\\n\\n...<|eot_id|>``).
"""

from __future__ import annotations

from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3}
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def build_chat_target(root: Path, style: str, seed: int = 0, zero_lm_head: bool = False) -> Path:
    """A target directory with the ``style`` template (``zero_lm_head``: every
    next token equally likely, so sampled texts end at random)."""
    import torch
    from transformers import AutoTokenizer

    from specdec.train.tokenizer import train_tokenizer
    from tiny import CORPUS, tiny_llama

    out = Path(root) / f"chat-{style}"
    train_tokenizer(CORPUS, out, vocab_size=300)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.chat_template = TEMPLATES[style]
    model = tiny_llama(len(tok), seed)
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>" if style == "chatml"
                                                                     else "<|eot_id|>")
    if zero_lm_head:
        with torch.no_grad():
            model.lm_head.weight.zero_()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
