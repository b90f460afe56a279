"""``specdec up`` serves the OpenAI-compatible API and prints where."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys

import openai

URL_LINE = re.compile(r"^specdec up: OpenAI-compatible API on (http://127\.0\.0\.1:(\d+)/v1)$")


def test_up_prints_and_serves_the_http_api(tiny_family):
    cmd = [sys.executable, "-m", "specdec.cli.main", "up", "--port", "0", "--target", str(tiny_family["target"]),
           "--method", "vanilla"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout.readline().startswith("specdec up: orchestrator on 127.0.0.1:")
        m = URL_LINE.match(proc.stdout.readline().strip())
        assert m, "no URL line"
        port = int(m.group(2))
        assert port != 8000, "--port 0 asks for free ports: the HTTP one too"
        with openai.OpenAI(base_url=m.group(1), api_key="unused", max_retries=0) as client:
            got = client.completions.create(model=client.models.list().data[0].id, prompt="def add(a, b):",
                                            max_tokens=5, temperature=0)
        assert got.usage.completion_tokens == 5
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0
