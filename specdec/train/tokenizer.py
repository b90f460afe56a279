"""Byte-level BPE tokenizer training (``tokenizers``), saved for ``AutoTokenizer``."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

EOS_TOKEN = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 4096) -> Path:
    """Train a byte-level BPE on ``texts`` and save it where
    ``AutoTokenizer.from_pretrained(out_dir)`` loads it. Deterministic for a
    given corpus and vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, unk_token=None,
        model_max_length=2048, clean_up_tokenization_spaces=False,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return out
