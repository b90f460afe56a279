"""What the HTTP API adds to a request's wall time over gRPC (a measurement, not a test).

    PYTHONPATH=. python tests/http_api/http_vs_grpc.py [--repeats 3] [--prompts 4] [--max-new-tokens 128]

Starts ``specdec up`` (the bundled demo family unless ``--up-args`` names
other models; eagle2, free ports), then
sends each bench prompt, greedy, for ``--max-new-tokens`` tokens, as four
kinds of request interleaved (order rotated per round): gRPC ``Complete`` and
streamed ``Generate`` (the SDK), HTTP ``/v1/completions`` whole and streamed
(httpx, one kept-alive connection). Every kind must produce the same tokens;
prints the median wall time per kind and HTTP's overhead over gRPC.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from specdec.client import SpecdecClient

PROMPTS = Path(__file__).resolve().parents[2] / "specdec" / "bench" / "prompts.jsonl"


def start_up(extra: list[str]) -> tuple[subprocess.Popen, str, str]:
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli.main", "up", "--port", "0", *extra],
                            stdout=subprocess.PIPE, text=True)
    grpc_line, http_line = proc.stdout.readline(), proc.stdout.readline()
    address = re.search(r"orchestrator on (\S+)", grpc_line).group(1)
    url = re.search(r"API on (\S+)", http_line).group(1)
    return proc, address, url


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--up-args", default="", help="more `specdec up` flags, e.g. '--target DIR --eagle DIR'")
    args = p.parse_args()
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()[:args.prompts]]
    proc, address, url = start_up(args.up_args.split())
    n = args.max_new_tokens
    try:
        sdk = SpecdecClient(address, timeout=600)
        http = httpx.Client(base_url=url, timeout=600)
        model = http.get("/models").json()["data"][0]["id"]
        body = {"model": model, "max_tokens": n, "temperature": 0, "return_token_ids": True}

        def grpc_whole(prompt):
            return sdk.complete(prompt, max_new_tokens=n).token_ids

        def grpc_stream(prompt):
            stream = sdk.generate(prompt, max_new_tokens=n)
            return [t for chunk in stream for t in chunk.token_ids]

        def http_whole(prompt):
            return http.post("/completions", json={**body, "prompt": prompt}).json()["choices"][0]["token_ids"]

        def http_stream(prompt):
            ids = []
            with http.stream("POST", "/completions", json={**body, "prompt": prompt, "stream": True}) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        ids += json.loads(line[6:])["choices"][0].get("token_ids", [])
            return ids

        kinds = {"grpc": grpc_whole, "grpc-stream": grpc_stream, "http": http_whole, "http-stream": http_stream}
        for fn in kinds.values():                 # warm-up
            fn(prompts[0])
        times: dict[str, list[float]] = {k: [] for k in kinds}
        names = list(kinds)
        for r in range(args.repeats):
            for i, prompt in enumerate(prompts):
                shift = (r * len(prompts) + i) % len(names)
                outputs = {}
                for name in names[shift:] + names[:shift]:
                    t = time.perf_counter()
                    outputs[name] = kinds[name](prompt)
                    times[name].append(time.perf_counter() - t)
                assert len({tuple(o) for o in outputs.values()}) == 1, f"outputs differ on prompt {i}"
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in med.items():
            print(f"{k:12s} median {v * 1e3:8.1f} ms  mean {statistics.mean(times[k]) * 1e3:8.1f} ms  "
                  f"({len(times[k])} requests of {n} tokens)")
        print(f"HTTP over gRPC: whole {100 * (med['http'] / med['grpc'] - 1):+.2f}%, "
              f"streamed {100 * (med['http-stream'] / med['grpc-stream'] - 1):+.2f}%")
        http.close()
        sdk.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


if __name__ == "__main__":
    main()
