"""Prompts to token ids with a Hugging Face tokenizer: a text with the
tokenizer's special tokens, or a chat (``[{"role", "content"}, ...]``)
rendered with the tokenizer's chat template, the generation prompt added.
What ``specdec generate --local`` and ``specdec bench`` feed the target; the
services render chats in the orchestrator (``orchestrator.chat_template``).
"""

from __future__ import annotations

from specdec.request.errors import UsageError


def prompt_ids(tokenizer, prompt: str | list[dict]) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise UsageError("prompt must not be empty")
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    return list(tokenizer(chat_text(tokenizer, prompt), add_special_tokens=False)["input_ids"])


def chat_text(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The chat rendered as the target reads it (its special tokens written out),
    with the header of the assistant's next turn unless ``add_generation_prompt``
    is False (a conversation that ends as it is, as in training data)."""
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("chat prompts need a chat template, and the target's tokenizer has none")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
