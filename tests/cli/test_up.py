"""``specdec up`` as real subprocesses, and ``specdec generate --server``
printing what ``--local`` prints."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from running_stack import Stack
from specdec.cli.main import main

UP_LINE = re.compile(r"^specdec up: orchestrator on 127\.0\.0\.1:(\d+) \((.*)\)$")


def up_cmd(family, *extra):
    return [sys.executable, "-m", "specdec.cli.main", "up", "--port", "0", "--target", str(family["target"]), *extra]


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def ports_of(line: str) -> list[int]:
    m = UP_LINE.match(line)
    assert m, line
    return [int(m.group(1))] + [int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", m.group(2))]


def refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_up_streams_a_demo_generation_and_exits(tiny_family):
    cmd = up_cmd(tiny_family, "--eagle", str(tiny_family["eagle"]), "--demo-generation", "--exit-after-demo",
                 "--demo-max-new-tokens", "12")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    ports = ports_of(lines[0])
    assert len(ports) == 3 and "verifier" in lines[0] and "drafter" in lines[0]
    assert "def fibonacci(n):" in proc.stdout
    stats = lines[-1]
    assert re.search(r"\[12 tokens in \d+ cycles, tau \d+\.\d+, [\d.]+ tok/s", stats), stats
    assert all(word in stats for word in ("draft", "verify", "network", "other"))
    assert all(refused(p) for p in ports)          # every process is gone


def test_the_demo_of_a_chat_target_is_a_chat_answer(tmp_path):
    """A target with a chat template: the demo asks a question in it (the
    orchestrator renders the template) instead of completing code."""
    from chat_tiny import build_chat_target
    from specdec.cli.up import DEMO_QUESTION

    target = build_chat_target(tmp_path, "chatml")
    cmd = [sys.executable, "-m", "specdec.cli.main", "up", "--port", "0", "--target", str(target), "--method",
           "vanilla", "--demo-generation", "--exit-after-demo", "--demo-max-new-tokens", "6"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"user: {DEMO_QUESTION}\nassistant: " in proc.stdout and "def fibonacci" not in proc.stdout
    assert re.search(r"\[6 tokens in \d+ cycles", proc.stdout.splitlines()[-1])


def test_up_stops_everything_on_sigterm(tiny_family):
    proc = subprocess.Popen(up_cmd(tiny_family, "--method", "vanilla"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env())
    try:
        line = proc.stdout.readline().strip()
        ports = ports_of(line)
        assert len(ports) == 2 and "drafter" not in line       # vanilla: no drafter process
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert all(refused(p) for p in ports)


def test_a_second_sigterm_while_stopping_still_stops_everything(tiny_family, tmp_path):
    """A supervisor that repeats its SIGTERM (or a second Ctrl-C) while ``up``
    waits for its children to drain must not leave them running."""
    state_file = tmp_path / "stack.json"
    proc = subprocess.Popen(up_cmd(tiny_family, "--method", "vanilla", "--state", str(state_file)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    pids = []
    try:
        ports = ports_of(proc.stdout.readline().strip())
        pids = [v["pid"] for v in json.loads(state_file.read_text())["verifiers"]]
        proc.send_signal(signal.SIGTERM)
        # (lines before it are the children's own logs and warnings)
        assert "specdec up: stopping" in iter(lambda: proc.stderr.readline().strip(), "")
        proc.send_signal(signal.SIGTERM)                 # while the verifier drains
        assert proc.wait(60) == 0
        assert all(refused(p) for p in ports)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in pids:                                 # what a failing run would leave behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_up_exits_nonzero_naming_the_child_that_died(tiny_family, tmp_path):
    broken = tmp_path / "broken-lm"
    broken.mkdir()
    (broken / "config.json").write_text(Path(tiny_family["draft-lm"], "config.json").read_text())
    proc = subprocess.run(up_cmd(tiny_family, "--draft-lm", str(broken)), capture_output=True, text=True,
                          timeout=180, env=env())
    assert proc.returncode == 1
    assert "specdec up: the drafter exited with status" in proc.stderr
    assert "specdec up: orchestrator on" not in proc.stdout


def test_up_rejects_missing_model_dirs_in_one_line(tiny_family, tmp_path, capsys):
    assert main(["up", "--target", str(tiny_family["target"]), "--eagle", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "EAGLE head directory" in err[0]


# -- specdec generate --server ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(tiny_family):
    s = Stack(tiny_family)
    s.add_verifier("verifier")
    s.add_drafter("drafter", "eagle")
    s.add_orchestrator("orchestrator", drafter="drafter")
    yield s
    s.close()


@pytest.mark.parametrize("method", ["eagle2", "vanilla"])
def test_generate_server_prints_what_local_prints(tiny_family, stack, tmp_path, capsys, method):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "import os"]))
    common = ["generate", "--json", "--max-new-tokens", "16", "--method", method, "--prompt-file", str(prompts),
              "--target", str(tiny_family["target"]), "--eagle", str(tiny_family["eagle"])]
    assert main(common + ["--local"]) == 0
    local = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main(common + ["--server", stack.address("orchestrator")]) == 0
    remote = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(remote) == len(local) == 2
    for got, want in zip(remote, local):
        assert set(got) == set(want) == {"token_ids", "text", "cycles", "tau", "accepted_per_position", "wall_s"}
        want.pop("wall_s"), got.pop("wall_s")
        assert got == want


def test_generate_server_streams_text(tiny_family, stack, capsys):
    assert main(["generate", "--server", stack.address("orchestrator"), "--max-new-tokens", "8", "x = "]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("x = ") and "tokens" in err and "tau" in err


@pytest.mark.parametrize("args,needle", [
    (["--max-new-tokens", "5000", "hi"], "max_new_tokens must be <= 2048"),
    (["--total-tokens", "0", "hi"], "total_tokens"),
    ([""], "prompt must not be empty"),
])
def test_generate_server_errors_are_one_line(stack, capsys, args, needle):
    assert main(["generate", "--server", stack.address("orchestrator"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_generate_server_unreachable_is_one_line(capsys):
    t0 = time.monotonic()
    assert main(["generate", "--server", "127.0.0.1:1", "--timeout", "5", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "UNAVAILABLE" in err[0] and time.monotonic() - t0 < 10


def test_a_lone_verifier_sharing_the_cores_gets_solo_threads(monkeypatch):
    """``up`` splits the cores between drafter and verifier and lets the one
    verifier use them all while a single session runs; never over the user's
    OMP_NUM_THREADS, nor where the verifier has the cores to itself."""
    from specdec import procs
    from specdec.cli import up

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert procs.threads_per_process(2) == 2 and procs.solo_threads(2, 2) == 4
    assert procs.solo_threads(4, 1) == 0                      # verifier alone: already all cores
    assert procs.solo_threads(1, 4) == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert procs.solo_threads(2, 2) == 0
    assert procs.solo_env() == {"GOMP_SPINCOUNT": procs.SOLO_SPINCOUNT}
    monkeypatch.setenv("SPECDEC_LOOKAHEAD", "0")
    assert not up.drafts_ahead()
    monkeypatch.setenv("SPECDEC_LOOKAHEAD", "1")      # the drafter then computes during verifies
    assert up.drafts_ahead()


def test_up_serves_a_gguf_target_with_a_chat_template(tiny_family, tmp_path):
    """A GGUF file as --target (converted once, every process given the directory) and
    --chat-template passed to the orchestrator: chats render with it over HTTP."""
    import httpx

    from specdec.model.gguf_export import export_llama

    target = export_llama(tiny_family["target"], tmp_path / "tiny.gguf", quant="Q8_0")
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}# {{ m['content'] }}\n{% endfor %}")
    cmd = [sys.executable, "-m", "specdec.cli.main", "up", "--port", "0", "--http-port", "0", "--target", str(target),
           "--method", "vanilla", "--chat-template", str(template)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**env(), "SPECDEC_MODEL_CACHE": str(tmp_path / "models")})
    try:
        assert UP_LINE.match(proc.stdout.readline().strip())
        http = re.search(r"http://127\.0\.0\.1:(\d+)/v1", proc.stdout.readline()).group(1)
        models = httpx.get(f"http://127.0.0.1:{http}/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == [str(target.resolve())]       # named by the file the user gave
        body = {"model": str(target.resolve()), "max_tokens": 6, "temperature": 0,
                "messages": [{"role": "user", "content": "def add(a, b):"}]}
        reply = httpx.post(f"http://127.0.0.1:{http}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        prompt_tokens = reply.json()["usage"]["prompt_tokens"]
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(next((tmp_path / "models").iterdir()))
        assert prompt_tokens == len(tok("# def add(a, b):\n")["input_ids"])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_up_rejects_a_missing_chat_template_in_one_line(tiny_family, tmp_path, capsys):
    assert main(["up", "--target", str(tiny_family["target"]), "--method", "vanilla",
                 "--chat-template", str(tmp_path / "none.jinja")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "chat template file not found" in err[0]


def test_a_half_precision_targets_eagle_head_drafts_in_float32(tiny_family):
    """As in process: the head keeps float32 under a bfloat16 target (docs/models.md, "Precision")."""
    from specdec.cli.main import build_parser
    from specdec.cli.up import _model_argv

    target, eagle = str(tiny_family["target"]), str(tiny_family["eagle"])
    verifier, drafter, _ = _model_argv(build_parser().parse_args(["up", "--target", target, "--eagle", eagle,
                                                                  "--dtype", "bfloat16"]))
    assert build_parser().parse_args(["verifier", "serve", *verifier]).dtype == "bfloat16"
    assert build_parser().parse_args(["drafter", "serve", *drafter]).dtype == "float32"
