"""``specdec generate --local``: JSON output and one-line errors for bad input."""

import json
import re
import subprocess
import sys

import pytest

from specdec.cli.main import main


def model_flags(family, drafter="eagle"):
    flags = ["--target", str(family["target"])]
    return flags + {"eagle": ["--eagle", str(family["eagle"])], "draft-lm": ["--draft-lm", str(family["draft-lm"])],
                    "ngram": ["--ngram"], "none": []}[drafter]


def run_cli(capsys, args):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("drafter,method", [("none", "vanilla"), ("eagle", "eagle2"), ("draft-lm", "chain"),
                                            ("ngram", "static")])
def test_json_lines_match_vanilla(tiny_family, tmp_path, capsys, drafter, method):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p, "id": i}) for i, p in
                                 enumerate(["def add(a, b):", "for i in range(3):", "import os"])))
    common = ["generate", "--local", "--json", "--max-new-tokens", "24", "--prompt-file", str(prompts)]
    code, out, _ = run_cli(capsys, common + model_flags(tiny_family, drafter) + ["--method", method])
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    code, ref_out, _ = run_cli(capsys, common + model_flags(tiny_family, "none") + ["--method", "vanilla"])
    ref = [json.loads(line) for line in ref_out.splitlines()]
    assert len(rows) == 3
    for row, want in zip(rows, ref):
        assert set(row) == {"token_ids", "text", "cycles", "tau", "accepted_per_position", "wall_s"}
        assert row["token_ids"] == want["token_ids"]
        generated_in_cycles = len(row["token_ids"]) - 1       # the first token comes from prefill
        if method == "vanilla":
            assert row["tau"] == 1.0 and row["cycles"] == generated_in_cycles
        else:  # the last cycle may be cut by max_new_tokens
            assert row["tau"] * row["cycles"] >= generated_in_cycles - 1e-3
            assert sum(row["accepted_per_position"][:1]) <= row["cycles"]


@pytest.mark.parametrize("args,needle", [
    (["--temperature", "-1", "hi"], "temperature must be >= 0"),
    (["--top-p", "0", "hi"], "top_p must be in (0, 1]"),
    (["--top-p", "1.5", "hi"], "top_p must be in (0, 1]"),
    ([""], "prompt must not be empty"),
    (["--max-new-tokens", "0", "hi"], "max-new-tokens must be >= 1"),
    (["--max-new-tokens", "100000", "hi"], "exceeds the model's context"),
    (["--total-tokens", "0", "hi"], "total_tokens must be an integer >= 1"),
    (["--prompt-file", "/nonexistent.jsonl"], "prompt file not found"),
    (["--min-tau", "-1", "hi"], "must be >= 0 or auto"),
    (["--min-tau", "often", "hi"], "--min-tau"),
    (["--min-p", "1.5", "hi"], "min_p must be in [0, 1]"),
    (["--presence-penalty", "2.5", "hi"], "presence_penalty must be in [-2, 2]"),
    (["--frequency-penalty", "-3", "hi"], "frequency_penalty must be in [-2, 2]"),
    (["--repetition-penalty", "0", "hi"], "repetition_penalty must be > 0 and finite"),
    (["--logprobs", "21", "hi"], "--logprobs must be in [0, 20]"),
    (["--logit-bias", "5", "hi"], "--logit-bias takes TOKEN=BIAS"),
    (["--logit-bias", "x=1", "hi"], "--logit-bias takes TOKEN=BIAS"),
    (["--logit-bias", "5=101", "hi"], "logit_bias[5] must be in [-100, 100]"),
    (["--logit-bias", "100000=1", "hi"], "logit_bias: token id 100000 is outside the vocabulary"),
])
def test_bad_input_is_one_line_and_nonzero(tiny_family, capsys, args, needle):
    code, out, err = run_cli(capsys, ["generate", "--local", *model_flags(tiny_family), *args])
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specdec: error:") and needle in lines[0], err


def test_malformed_prompt_file_names_the_line(tiny_family, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    code, _, err = run_cli(capsys, ["generate", "--local", *model_flags(tiny_family), "--prompt-file", str(bad)])
    assert code == 2 and f"{bad}:2: not valid JSON" in err


def test_console_script_exit_status(tiny_family):
    """The installed entry point, as a user runs it."""
    proc = subprocess.run([sys.executable, "-m", "specdec.cli.main", "generate", "--local",
                           *model_flags(tiny_family), "--temperature", "-0.5", "x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("specdec:")]
    assert len(lines) == 1 and "temperature must be >= 0" in lines[0], proc.stderr


@pytest.mark.parametrize("drafter,method", [("eagle", "eagle2"), ("ngram", "chain")])
def test_penalties_and_logprobs_match_vanilla(tiny_family, capsys, drafter, method):
    flags = ["generate", "--local", "--json", "--max-new-tokens", "16", "--repetition-penalty", "1.4",
             "--frequency-penalty", "0.5", "--min-p", "0.05", "--logprobs", "2", "def add(a, b):"]
    code, out, _ = run_cli(capsys, flags + model_flags(tiny_family, drafter) + ["--method", method])
    assert code == 0
    code, ref_out, _ = run_cli(capsys, flags + model_flags(tiny_family, "none") + ["--method", "vanilla"])
    row, want = json.loads(out), json.loads(ref_out)
    code, plain_out, _ = run_cli(capsys, ["generate", "--local", "--json", "--max-new-tokens", "16", "def add(a, b):",
                                          *model_flags(tiny_family, "none"), "--method", "vanilla"])
    assert row["token_ids"] == want["token_ids"] != json.loads(plain_out)["token_ids"]
    assert [e["token"] for e in row["logprobs"]] == row["token_ids"]
    for got, ref in zip(row["logprobs"], want["logprobs"]):
        assert got["logprob"] == pytest.approx(ref["logprob"], abs=1e-5) and len(got["top"]) == 2


def test_logit_bias_matches_vanilla_and_bans_a_token(tiny_family, capsys):
    common = ["generate", "--local", "--json", "--max-new-tokens", "16", "def add(a, b):"]
    _, plain_out, _ = run_cli(capsys, common + model_flags(tiny_family, "none") + ["--method", "vanilla"])
    banned = json.loads(plain_out)["token_ids"][0]
    flags = common + ["--logit-bias", f"{banned}=-100", "--logit-bias", "7=1.5"]
    code, out, _ = run_cli(capsys, flags + model_flags(tiny_family, "eagle") + ["--method", "eagle2"])
    assert code == 0
    _, ref_out, _ = run_cli(capsys, flags + model_flags(tiny_family, "none") + ["--method", "vanilla"])
    assert json.loads(out)["token_ids"] == json.loads(ref_out)["token_ids"]
    assert banned not in json.loads(out)["token_ids"]


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant> {% endif %}")


def test_chat_prompts_render_with_the_targets_template(tiny_family, tmp_path, capsys):
    """--chat and {"messages": ...} lines are the chat rendered with the target's template:
    the same tokens as the rendered text given as a plain prompt."""
    import shutil

    target = tmp_path / "target"
    shutil.copytree(tiny_family["target"], target)
    (target / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    common = ["generate", "--local", "--json", "--max-new-tokens", "12", "--target", str(target), "--ngram",
              "--method", "eagle2"]
    code, out, err = run_cli(capsys, common + ["--chat", "def add(a, b):"])
    assert code == 0, err
    chat = json.loads(out)["token_ids"]
    lines = tmp_path / "chats.jsonl"
    lines.write_text(json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": "def add(a, b):"}]}) + "\n")
    code, out, _ = run_cli(capsys, common + ["--prompt-file", str(lines)])
    with_system = json.loads(out)["token_ids"]
    for text, want in (("<user> def add(a, b):\n<assistant> ", chat),
                       ("<system> be brief\n<user> def add(a, b):\n<assistant> ", with_system)):
        code, out, _ = run_cli(capsys, common[:-2] + ["--method", "vanilla", text])
        assert code == 0 and json.loads(out)["token_ids"] == want


@pytest.mark.parametrize("line,needle", [
    ({"messages": []}, "\"messages\" must be a non-empty list"),
    ({"messages": [{"role": "user"}]}, "\"messages\" must be a non-empty list"),
    ({"text": "hi"}, "expected an object with a string \"prompt\" or a \"messages\" list"),
])
def test_bad_chat_lines_are_one_line(tiny_family, tmp_path, capsys, line, needle):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(line) + "\n")
    code, _, err = run_cli(capsys, ["generate", "--local", *model_flags(tiny_family), "--prompt-file", str(bad)])
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_a_chat_without_a_template_is_one_line(tiny_family, capsys):
    code, _, err = run_cli(capsys, ["generate", "--local", *model_flags(tiny_family, "none"), "--method", "vanilla",
                                    "--chat", "hi"])
    assert code == 2 and "need a chat template" in err and len(err.strip().splitlines()) == 1


def test_structured_output_flags(tiny_family, tmp_path, capsys):
    """--json-schema / --regex / --grammar / --json-object: the output follows
    them, speculative equal to vanilla; a bad one is one line naming it."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "answer: " ("yes" | "no")')
    checks = {("--json-schema", str(schema)): lambda t: json.loads(t) in ({"ok": True}, {"ok": False}),
              ("--regex", "(x[yz]|y[xz]){2}"): lambda t: re.fullmatch("(x[yz]|y[xz]){2}", t),
              ("--grammar", str(grammar)): lambda t: t in ("answer: yes", "answer: no"),
              ("--json-object",): lambda t: isinstance(json.loads(t), dict)}
    for flags, check in checks.items():
        common = ["generate", "--local", "--json", "--max-new-tokens", "40", *flags, "def add(a, b):"]
        code, out, _ = run_cli(capsys, common + model_flags(tiny_family))
        assert code == 0
        row = json.loads(out)
        assert check(row["text"]), (flags, row["text"])
        _, ref, _ = run_cli(capsys, common + model_flags(tiny_family, "none") + ["--method", "vanilla"])
        assert json.loads(ref)["token_ids"] == row["token_ids"]
    code, _, err = run_cli(capsys, ["generate", "--local", "--regex", "a(", "hi"] + model_flags(tiny_family))
    assert code == 2 and "does not compile" in err and len(err.strip().splitlines()) == 1
