"""Helpers of the HTTP API tests: a tiny-family stack with the OpenAI-compatible
API on its orchestrator (127.0.0.1, free ports). The ``api`` fixture (conftest)
serves, on the same orchestrator:

- "eagle": orchestrator with the EAGLE drafter, a chat template, no token;
- "plain": the same orchestrator, no chat template;
- "auth": the same orchestrator, bearer token ``TOKEN``;
- "timeout": the same orchestrator, a 0.3 s request timeout.
"""

from __future__ import annotations

import json
import shutil
import time

from orchestrator.http import HttpConfig
from orchestrator.http_server import start_http
from running_stack import Stack

TOKEN = "s3cret-test-token"
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def chat_tokenizer_dir(tiny_family, tmp_path):
    """A copy of the target's tokenizer files with ``CHAT_TEMPLATE`` in tokenizer_config.json."""
    out = tmp_path / "chat-tokenizer"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_family["target"] / name, out / name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


class Api:
    def __init__(self, stack: Stack):
        self.stack = stack
        self.http: dict[str, object] = {}

    def serve(self, name: str, orchestrator: str, **cfg) -> str:
        self.http[name] = self.stack.loop.run(start_http(self.stack.servicer(orchestrator), HttpConfig(**cfg)))
        return self.url(name)

    def url(self, name: str) -> str:
        return f"{self.http[name].url}/v1"

    def root(self, name: str) -> str:
        return self.http[name].url

    def stop(self, name: str) -> None:
        self.stack.loop.run(self.http.pop(name).stop())

    @property
    def model(self) -> str:
        return self.stack.servicer("eagle").verifier_info.model

    def wait_closed(self, timeout: float = 2.0) -> dict[str, int]:
        return self.stack.wait_sessions_closed("verifier", "drafter-eagle", timeout=timeout)

    def close(self) -> None:
        for name in list(self.http):
            self.stop(name)
        self.stack.close()


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
