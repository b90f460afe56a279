"""Chat data for EAGLE heads: assistant-only masks under two template styles,
regeneration by the target (batched == one by one == plain greedy decoding,
resumable), Magpie prompts (de-duplicated, split without overlap), and
one-line errors for bad input."""

import json

import pytest
import torch

from chat_tiny import build_chat_target
from specdec.cli.main import main
from specdec.model.loading import ModelSpec, load_causal_lm, load_tokenizer
from specdec.model.prompts import chat_text
from specdec.train.chat import chat_tokens
from specdec.train.magpie import PromptFilter, end_of_turn_ids, normalised, user_header, write_prompts
from specdec.train.regenerate import GenerateOptions, generate_batch, regenerate, stop_ids

TWO_TURNS = [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "return a + b"},
             {"role": "user", "content": "for i in range(10):"}, {"role": "assistant", "content": "print(i * i)"}]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {style: build_chat_target(root, style) for style in ("chatml", "llama3")}


def expected(tok, pieces):
    """(ids, assistant flags) of text pieces [(text, is_assistant)], each encoded on its own."""
    ids, flags = [], []
    for text, mine in pieces:
        enc = tok(text, add_special_tokens=False)["input_ids"]
        ids += enc
        flags += [mine] * len(enc)
    return ids, flags


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_the_mask_is_exactly_the_assistant_tokens(targets, style):
    tok = load_tokenizer(targets[style])
    if style == "chatml":
        pieces = [("<|im_start|>user\ndef add(a, b):<|im_end|>\n<|im_start|>assistant\n", False),
                  ("return a + b<|im_end|>\n", True),
                  ("<|im_start|>user\nfor i in range(10):<|im_end|>\n<|im_start|>assistant\n", False),
                  ("print(i * i)<|im_end|>\n", True)]
    else:
        pieces = [("<|endoftext|><|start_header_id|>user<|end_header_id|>\n\ndef add(a, b):<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n", False),
                  ("return a + b<|eot_id|>", True),
                  ("<|start_header_id|>user<|end_header_id|>\n\nfor i in range(10):<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n", False),
                  ("print(i * i)<|eot_id|>", True)]
    assert "".join(p for p, _ in pieces) == chat_text(tok, TWO_TURNS, add_generation_prompt=False)
    ids, flags = expected(tok, pieces)
    got = chat_tokens(tok, TWO_TURNS)
    assert got.ids == ids and got.assistant == flags
    assert got.loss_mask().tolist() == flags[1:] + [False]      # position p predicts token p + 1


def greedy(model, ids, n, stops):
    """Plain greedy decoding: one full forward per token, no cache."""
    out = []
    for _ in range(n):
        with torch.no_grad():
            nxt = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
        if nxt in stops:
            break
        out.append(nxt)
    return out


def test_regeneration_is_the_targets_greedy_answer_batched_and_resumable(targets, tmp_path):
    target_dir = targets["chatml"]
    model, tok = load_causal_lm(ModelSpec(str(target_dir))), load_tokenizer(target_dir)
    chats = [TWO_TURNS, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "class Point:"}],
             [{"role": "user", "content": "import os"}]]
    opts = GenerateOptions(max_new_tokens=7, batch=3)
    batched, made, _ = regenerate(model, tok, chats, tmp_path / "b.jsonl", opts, progress=False)
    assert made == 3
    one, _, _ = regenerate(model, tok, chats, tmp_path / "one.jsonl", GenerateOptions(max_new_tokens=7, batch=1),
                        progress=False)
    assert batched == one
    stops = stop_ids(tok, model)
    for source, got in zip(chats, batched):
        assert [m["role"] for m in got] == [m["role"] for m in source] + (["assistant"] if source[-1]["role"] ==
                                                                           "user" else [])
        for i, m in enumerate(got):
            if m["role"] != "assistant":
                assert m == source[i]
                continue
            prompt = tok(chat_text(tok, got[:i]), add_special_tokens=False)["input_ids"]
            assert m["content"] == tok.decode(greedy(model, prompt, 7, stops), skip_special_tokens=False)
    # a rerun over more conversations keeps what is written and generates only the rest
    part = tmp_path / "part.jsonl"
    regenerate(model, tok, chats[:2], part, opts, progress=False)
    first = part.read_text().splitlines()
    again, made, _ = regenerate(model, tok, chats, part, opts, progress=False)
    assert made == 1 and part.read_text().splitlines()[:2] == first and again == batched


@pytest.mark.parametrize("style,header,closing", [("chatml", "<|im_start|>user\n", "<|im_end|>"),
                                                  ("llama3", "<|endoftext|><|start_header_id|>user<|end_header_id|>"
                                                             "\n\n", "<|eot_id|>")])
def test_magpie_reads_the_user_header_of_either_template(targets, style, header, closing):
    tok = load_tokenizer(targets[style])
    model = load_causal_lm(ModelSpec(str(targets[style])))
    head, tail = user_header(tok)
    assert head == header and tail.startswith(closing)
    assert tok.convert_tokens_to_ids(closing) in end_of_turn_ids(tok, model, tail)


def test_prompt_filter_drops_repeats_empties_degenerate_and_unfinished():
    kept = PromptFilter()
    offers = [("How do I sort a list?", True), ("how do i sort a list", True), ("  ", True),
              ("Name three rivers.", False), ("a a a a a a a a a a", True), ("Name three rivers.", True)]
    assert [kept.offer(t, f) for t, f in offers] == [True, False, False, False, False, True]
    assert kept.kept == ["How do I sort a list?", "Name three rivers."]
    assert kept.dropped == {"unfinished": 1, "degenerate": 2, "duplicate": 1}
    assert normalised(" How,  do I\nsort ") == "how do i sort"


def test_prompt_split_has_no_overlap(tmp_path):
    prompts = [f"Question number {i}?" for i in range(40)]
    train, held = write_prompts(prompts, tmp_path / "t.jsonl", tmp_path / "h.jsonl", 0.3)
    read = [[json.loads(line)["messages"][0]["content"] for line in (tmp_path / f).read_text().splitlines()]
            for f in ("t.jsonl", "h.jsonl")]
    assert (len(read[0]), len(read[1])) == (train, held) and train > 0 and held > 0
    assert not set(read[0]) & set(read[1]) and sorted(read[0] + read[1]) == sorted(prompts)


def test_chat_prompts_command_writes_distinct_finished_prompts(tmp_path, capsys):
    target = build_chat_target(tmp_path, "chatml", zero_lm_head=True)      # uniform: turns end at random
    out = tmp_path / "p.jsonl"
    args = ["train", "chat-prompts", "--target", str(target), "--n", "6", "--out", str(out), "--heldout-frac",
            "0.3", "--max-new-tokens", "40", "--batch", "16", "--max-draws", "320", "--threads", "1"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    files = [out, tmp_path / "p.heldout.jsonl"]
    texts = [[json.loads(line)["messages"] for line in f.read_text().splitlines()] for f in files]
    assert summary["kept"] == 6 == len(texts[0]) + len(texts[1]) and summary["dropped"]["unfinished"] > 0
    flat = [m for part in texts for m in part]
    assert all(len(m) == 1 and m[0]["role"] == "user" and m[0]["content"].strip() for m in flat)
    keys = [normalised(m[0]["content"]) for m in flat]
    assert len(set(keys)) == len(keys)


def test_chat_prompts_go_on_from_their_journal(tmp_path, capsys):
    """A run stopped early and rerun draws only what it lacked, from where it
    stopped: the prompts are those of one uninterrupted run, a torn journal line dropped."""
    target = build_chat_target(tmp_path, "chatml", zero_lm_head=True)

    def run(out, n):
        args = ["train", "chat-prompts", "--target", str(target), "--n", str(n), "--out", str(out),
                "--heldout-frac", "0", "--max-new-tokens", "40", "--batch", "8", "--threads", "1"]
        assert main(args) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    whole = run(tmp_path / "whole" / "p.jsonl", 6)
    first = run(tmp_path / "cut" / "p.jsonl", 2)
    journal = tmp_path / "cut" / "p.draws.jsonl"
    assert first["resumed_draws"] == 0 and len(journal.read_text().splitlines()) == first["drawn"]
    with journal.open("a") as f:
        f.write('{"text": "torn')                   # a run killed mid-write
    rest = run(tmp_path / "cut" / "p.jsonl", 6)
    assert rest["resumed_draws"] == first["drawn"] and rest["drawn"] == whole["drawn"]
    assert (tmp_path / "cut" / "p.jsonl").read_text() == (tmp_path / "whole" / "p.jsonl").read_text()


@pytest.mark.parametrize("line,message", [
    ({"prompt": "hi"}, "line 2: no \"messages\""),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "line 2: message 0 has unknown role 'bot'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "line 2: the conversation has no assistant turn"),
])
def test_bad_chat_lines_are_one_line_errors(targets, tmp_path, capsys, line, message):
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"messages": TWO_TURNS}) + "\n" + json.dumps(line) + "\n")
    code = main(["train", "eagle", "--target", str(targets["chatml"]), "--chat", str(data),
                 "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err and str(data) in err


def test_gzipped_chat_data_reads_as_the_plain_file(tmp_path):
    import gzip

    from specdec.request.errors import UsageError
    from specdec.train.chat import read_chats

    plain, packed, broken = tmp_path / "c.jsonl", tmp_path / "c.jsonl.gz", tmp_path / "b.jsonl.gz"
    plain.write_text("".join(json.dumps({"messages": TWO_TURNS}) + "\n" for _ in range(3)))
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    broken.write_bytes(gzip.compress(plain.read_bytes())[:-9])
    assert read_chats(packed) == read_chats(plain) and len(read_chats(plain)) == 3
    with pytest.raises(UsageError, match="not readable as gzipped"):
        read_chats(broken)


def test_a_target_without_a_chat_template_is_a_one_line_error(tiny_family, tmp_path, capsys):
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"messages": TWO_TURNS}) + "\n")
    code = main(["train", "eagle", "--target", str(tiny_family["target"]), "--chat", str(data),
                 "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "has no chat template" in err


def test_rows_that_stop_leave_the_batch_and_the_rest_still_decode_greedily(targets):
    """Stop ids taken from the rows' own greedy paths, so rows stop at different
    steps: every row is still its plain greedy decoding, cut at its first stop."""
    model, tok = load_causal_lm(ModelSpec(str(targets["chatml"]))), load_tokenizer(targets["chatml"])
    prompts = [tok(t)["input_ids"] for t in ("def add(a, b):", "import os\nimport sys", "x", "class Point:")]
    free = [greedy(model, p, 9, []) for p in prompts]
    stops = sorted({free[0][1], free[2][4]})
    got = generate_batch(model, prompts, stops, GenerateOptions(max_new_tokens=9), pad=0)
    for p, (ids, finished) in zip(prompts, got):
        want = greedy(model, p, 9, stops)
        assert ids == want and finished == (len(want) < 9)
    assert sum(f for _, f in got) >= 2 and len({len(i) for i, _ in got}) >= 2


def test_bf16_generation_is_greedy_decoding_of_the_bf16_forwards(targets, tmp_path):
    """At precision bf16 the forwards run in bf16 (the logits come out bf16) and
    each row is still plain greedy decoding of those forwards; the command casts
    the weights and writes what the in-process regeneration writes."""
    target_dir = targets["chatml"]
    model, tok = load_causal_lm(ModelSpec(str(target_dir))), load_tokenizer(target_dir)
    prompts = [tok(t)["input_ids"] for t in ("def add(a, b):", "import os\nimport sys", "x", "class Point:")]
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    got = generate_batch(model, prompts, [], GenerateOptions(max_new_tokens=9, precision="bf16"), pad=0)
    hook.remove()
    assert set(seen) == {torch.bfloat16}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert [ids for ids, _ in got] == [greedy(model, p, 9, []) for p in prompts]
    chats = [[{"role": "user", "content": "import os"}], [{"role": "user", "content": "class Point:"}]]
    data, out = tmp_path / "c.jsonl", tmp_path / "r.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    assert main(["train", "chat-regenerate", "--target", str(target_dir), "--chat", str(data), "--out", str(out),
                 "--max-new-tokens", "7", "--precision", "bf16", "--threads", "1"]) == 0
    want, _, _ = regenerate(model.to(torch.bfloat16), tok, chats, tmp_path / "w.jsonl",
                            GenerateOptions(max_new_tokens=7, precision="bf16"), progress=False)
    assert [json.loads(line)["messages"] for line in out.read_text().splitlines()] == want


def test_chat_prompts_leave_out_the_prompts_they_are_told_to(tmp_path, capsys):
    """A second run with the same seed draws the same samples: told to exclude the
    first run's prompts it keeps none of them (they drop as duplicates)."""
    target = build_chat_target(tmp_path, "chatml", zero_lm_head=True)

    def run(out, *extra):
        args = ["train", "chat-prompts", "--target", str(target), "--n", "6", "--out", str(out), "--heldout-frac",
                "0", "--max-new-tokens", "40", "--batch", "8", "--max-draws", "400", "--threads", "1", *extra]
        assert main(args) == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        return summary, {normalised(json.loads(line)["messages"][0]["content"])
                         for line in out.read_text().splitlines()}

    first, before = run(tmp_path / "a" / "p.jsonl")
    second, after = run(tmp_path / "b" / "p.jsonl", "--exclude", str(tmp_path / "a" / "p.jsonl"))
    assert len(before) == len(after) == 6 and not before & after
    assert second["excluded"] == 6 and second["dropped"]["duplicate"] >= 6 > first["dropped"]["duplicate"]
