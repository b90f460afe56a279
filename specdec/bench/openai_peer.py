"""``openai``: the bench prompts sent to any OpenAI-compatible server (``--openai-url``).

The same harness then measures specdec against a server a user already runs
(vLLM, SGLang, TGI, specdec's own HTTP API...): each prompt's text goes to
``POST {url}/completions``, streamed (``stream_options.include_usage``), with
the bench's max_new_tokens and temperature (greedy by default; sampled runs
send the bench's seed). Tokens/s counts the tokens the server generated over
the wall time of the request, prefill and HTTP included, like every method.

The generated token ids come from the response when the server returns them
(``return_token_ids``, vLLM's extra, which specdec honours), else from
encoding the returned text with the bench's tokenizer (close, but a text's
encoding need not be the tokens that produced it, so ``matches_vanilla`` is
only meaningful with token ids). A specdec server's per-request statistics
(the ``specdec`` object of the choice) give tau, acceptance and the time
split; other servers report tokens/s only.
"""

from __future__ import annotations

import json
import time
from typing import Callable

import httpx

from specdec.bench.runner import OPENAI_METHOD, Prompt, Sample
from specdec.request.errors import SpecdecError

__all__ = ["OPENAI_METHOD", "OpenAIPeer", "OpenAIPeerError"]

REQUEST_TIMEOUT_S = 600.0


class OpenAIPeerError(SpecdecError):
    """The server refused or failed a request (the CLI prints it on one line)."""

    code = "UNAVAILABLE"


class OpenAIPeer:
    def __init__(self, base_url: str, max_new_tokens: int, temperature: float, model: str | None = None,
                 api_key: str | None = None, encode: Callable[[str], list[int]] | None = None):
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=REQUEST_TIMEOUT_S)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.encode = encode
        self.model = model or self.served_model()

    def served_model(self) -> str:
        """The first model the server lists (GET /models)."""
        try:
            resp = self.client.get("/models")
            resp.raise_for_status()
            return resp.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise OpenAIPeerError(f"--openai-url {self.client.base_url}: cannot list its models ({exc}); "
                                  f"give --openai-model") from None

    def request(self, prompt: Prompt, seed: int | None) -> dict:
        body = {"model": self.model, "prompt": prompt.text, "max_tokens": self.max_new_tokens,
                "temperature": self.temperature, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}
        if self.temperature > 0 and seed is not None:
            body["seed"] = seed
        return body

    def run(self, prompt: Prompt, seed: int | None) -> Sample:
        t = time.perf_counter()
        text, final, usage = self.stream(self.request(prompt, seed))
        wall = time.perf_counter() - t
        tokens = final.get("token_ids")
        if tokens is None:
            if self.encode is None:
                raise OpenAIPeerError("the server returned no token ids and no tokenizer was given")
            tokens = self.encode(text)
        if usage and usage.get("completion_tokens") not in (None, len(tokens)):
            tokens = tokens[:usage["completion_tokens"]]
        stats = final.get("specdec")
        if not stats:
            return Sample(tokens=list(tokens), wall_s=wall)
        return Sample(tokens=list(tokens), wall_s=wall, cycles=stats["cycles"],
                      committed=round(stats["tau"] * stats["cycles"]),
                      accepted_counts=list(stats["accepted_per_position"]), draft_s=stats["draft_s"],
                      verify_s=stats["verify_s"], network_s=stats["network_s"], ahead_hits=stats.get("ahead_hits", 0),
                      ahead_committed=stats.get("ahead_committed", 0))

    def stream(self, body: dict) -> tuple[str, dict, dict | None]:
        """(the generated text, the choice's last chunk, usage) of one streamed completion."""
        parts: list[str] = []
        final: dict = {}
        usage = None
        try:
            with self.client.stream("POST", "/completions", json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise OpenAIPeerError(f"{resp.status_code}: {resp.text[:500]}")
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise OpenAIPeerError(str(chunk["error"].get("message")))
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or []:
                        parts.append(choice.get("text") or "")
                        if choice.get("finish_reason"):
                            final = choice
        except httpx.HTTPError as exc:
            raise OpenAIPeerError(f"request to {self.client.base_url} failed: {exc}") from None
        return "".join(parts), final, usage

    def close(self) -> None:
        self.client.close()
