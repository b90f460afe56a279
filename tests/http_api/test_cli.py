"""``specdec orchestrator serve --http-port``: the entry point of the orchestrator image serves the API."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import openai

from http_api.helpers import TOKEN, wait_until


def test_orchestrator_serve_with_http(api, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    stack = api.stack
    cmd = [sys.executable, "-m", "specdec.cli.stack", "orchestrator", "serve", "--port", "0",
           "--metrics-port", "off", "--verifier", stack.address("verifier"), "--drafter",
           stack.address("drafter-eagle"), "--tokenizer", str(stack.paths["target"]), "--http-port", "0",
           "--chat-template", str(template), "--served-model-name", "tiny", "--drain-s", "2"]
    env = {**os.environ, "SPECDEC_AUTH_TOKEN": TOKEN}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        record = json.loads(proc.stdout.readline())
        assert record["event"] == "listening" and record["http_port"] > 0
        root = f"http://127.0.0.1:{record['http_port']}"
        assert wait_until(lambda: httpx.get(root + "/health", timeout=5).status_code == 200, timeout=60)
        c = openai.OpenAI(base_url=root + "/v1", api_key=TOKEN, max_retries=0)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "def add(a, b):"}],
                                         max_tokens=6, temperature=0)
        with openai.OpenAI(base_url=api.url("eagle"), api_key="x", max_retries=0) as same:
            want = same.completions.create(model=api.model, prompt="def add(a, b):", max_tokens=6, temperature=0)
        assert chat.choices[0].message.content == want.choices[0].text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert stack.wait_sessions_closed("verifier", "drafter-eagle") == {"verifier": 0, "drafter-eagle": 0}


def test_sigterm_drains_an_http_stream(api):
    """A SIGTERM while a stream runs: the stream still ends with its last chunk
    and [DONE] (the drain waits for HTTP generations too), then the process exits."""
    stack = api.stack
    cmd = [sys.executable, "-m", "specdec.cli.stack", "orchestrator", "serve", "--port", "0",
           "--metrics-port", "off", "--verifier", stack.address("verifier"), "--tokenizer",
           str(stack.paths["target"]), "--http-port", "0", "--drain-s", "20"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        root = f"http://127.0.0.1:{json.loads(proc.stdout.readline())['http_port']}"
        assert wait_until(lambda: httpx.get(root + "/health", timeout=5).status_code == 200, timeout=60)
        body = {"prompt": "class Point:", "max_tokens": 300, "temperature": 0, "stream": True}
        with httpx.stream("POST", root + "/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line)
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        events = [first, *rest]
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "length"
        assert last["choices"][0]["specdec"]["completion_tokens"] == 300
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
