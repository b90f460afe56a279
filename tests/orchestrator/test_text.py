"""Streaming detokenization and stop strings (orchestrator/text.py)."""

import json
import random
import shutil

import pytest

from specdec.request.decoding import Decoding, StopCriteria
from orchestrator.text import REPLACEMENT, IncrementalDetokenizer, TextStream, TextTokenizer, validate_stop_strings

MIXED = "def f():  # 你好, wörld 🎉🚀 — ok\n    return '日本語' + \"ü\"\n"


@pytest.fixture(scope="module")
def tok(tiny_family):
    """A byte-level BPE: characters outside its small vocabulary are split into byte tokens."""
    return TextTokenizer.load(tiny_family["target"])


def stream_all(tok, ids, stop=(), step=1):
    """Feed ``ids`` through a Decoding like the orchestrator does; returns (chunks, decoding, stream)."""
    stream = TextStream(tok, stop)
    dec = Decoding(StopCriteria(max_new_tokens=10_000, eos_ids=tok.eos_ids, stop_check=stream.stop_check))
    chunks = []
    sent_tokens, sent_text = [], ""
    for i in range(0, len(ids), step):
        dec.add(ids[i:i + step])
        chunks.append(stream.take())
        if dec.done:
            break
        # Mid-stream, a token goes out only with (or after) all of its text.
        sent_tokens += chunks[-1].token_ids
        sent_text += chunks[-1].text
        assert sent_text.startswith(tok.decode(sent_tokens).rstrip(REPLACEMENT))
    chunks.append(stream.finish())
    assert [t for c, _ in chunks for t in c] == dec.tokens == stream.tokens
    return chunks, dec, stream


def test_tokenizer_matches_transformers(tok, tiny_family):
    from specdec.model.loading import load_tokenizer

    hf = load_tokenizer(tiny_family["target"])
    for text in [MIXED, "x", "  leading spaces", "<|endoftext|> after eos"]:
        ids = hf(text, add_special_tokens=True)["input_ids"]
        assert tok.encode(text) == ids
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.eos_ids == {hf.eos_token_id}


def test_eos_from_config_when_tokenizer_config_lacks_it(tiny_family, tmp_path):
    shutil.copy(tiny_family["target"] / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [0, 7]}))
    assert TextTokenizer.load(tmp_path).eos_ids == {0, 7}
    with pytest.raises(ValueError, match="no tokenizer.json"):
        TextTokenizer.load(tmp_path / "missing")


def test_multibyte_characters_split_across_tokens(tok):
    ids = tok.encode(MIXED)
    single = [tok.decode([i]) for i in ids]
    assert any(REPLACEMENT in s for s in single), "the sample must split characters across tokens"
    detok = IncrementalDetokenizer(tok.decode)
    deltas = [detok.push(i) for i in ids]
    assert "" in deltas  # a token holding half a character releases nothing yet
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == MIXED
    assert detok.marks_chars[-1] == len(MIXED) and detok.marks_tokens[-1] == len(ids)


@pytest.mark.parametrize("seed", range(4))
def test_random_tokens_concatenate_to_full_decode(tok, seed):
    rng = random.Random(seed)
    # Byte tokens (ids < 260 are mostly single bytes) make invalid and split UTF-8 likely.
    ids = [rng.randrange(1, 260) if rng.random() < 0.6 else rng.randrange(1, tok.vocab_size) for _ in range(120)]
    detok = IncrementalDetokenizer(tok.decode)
    out = "".join(detok.push(i) for i in ids) + detok.flush()
    assert out == tok.decode(ids)


def test_stream_without_stop_strings_matches_decode(tok):
    ids = tok.encode(MIXED)
    chunks, dec, stream = stream_all(tok, ids, step=3)
    assert dec.tokens == ids
    assert "".join(text for _, text in chunks) == MIXED == stream.text
    assert all(REPLACEMENT not in text for _, text in chunks)
    assert dec.finish_reason is None


@pytest.mark.parametrize("step", [1, 2, 5])
@pytest.mark.parametrize("stop", ["return", "'日本", "🚀 —", "\n    "])
def test_stop_string_spanning_chunks(tok, stop, step):
    ids = tok.encode(MIXED)
    chunks, dec, stream = stream_all(tok, ids, stop=[stop, "never-there"], step=step)
    expected = MIXED[:MIXED.index(stop)]
    texts = [text for _, text in chunks]
    assert "".join(texts) == expected == stream.text
    assert dec.finish_reason == "stop"
    # The kept tokens cover the text before the stop string and no token more.
    assert tok.decode(dec.tokens).startswith(expected)
    assert len(tok.decode(dec.tokens[:-1]).rstrip(REPLACEMENT)) < len(expected)


def test_text_that_may_begin_a_stop_string_is_held_back(tok):
    stream = TextStream(tok, ["bcd"])
    tokens: list[int] = []

    def feed(text):
        tokens.extend(tok.encode(text))
        assert stream.stop_check(tokens) is None
        return stream.take().text

    assert feed("xab") == "xa"      # "b" may start "bcd"
    assert feed("c") == ""          # "bc" still may
    assert feed("e") == "bce"       # it did not
    assert stream.finish().text == ""
    held = TextStream(tok, ["zz"])
    held.stop_check(tok.encode("az"))
    assert held.take().text == "a"
    assert held.finish().text == "z"     # generation ended: the partial match is text after all


def test_stop_string_at_the_very_start(tok):
    ids = tok.encode("STOP here")
    chunks, dec, stream = stream_all(tok, ids, stop=["STOP"])
    assert stream.text == "" and dec.tokens == [] and dec.finish_reason == "stop"


def test_eos_is_kept_as_a_token_but_not_as_text(tok):
    ids = tok.encode("abc") + sorted(tok.eos_ids) + tok.encode("never")
    chunks, dec, stream = stream_all(tok, ids, step=2)
    assert dec.finish_reason == "eos"
    assert stream.text == "abc" and dec.tokens[-1] in tok.eos_ids


def test_stop_string_validation():
    assert validate_stop_strings(("a", "bc")) == ["a", "bc"]
    for bad in ([""], ["x" * 1000], ["s"] * 100):
        with pytest.raises(ValueError, match="^stop"):
            validate_stop_strings(bad)
