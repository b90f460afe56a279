"""``specdec bench prefix``: what the prefix cache buys (``specdec.model.prefix_cache``).

Every request is one shared system prompt of ``system_tokens`` tokens (the
bench prompts' text, concatenated and cut) followed by its own user prompt
(the bench prompts in turn). Each request runs twice, back to back, over the
same target weights: on engines with the prefix cache (verifier and drafter)
and on engines without it. The first request finds the cache cold, every
later one finds the system prompt's blocks. The record has each request's
time to first token on both, the cold / warm ratio (the first request's over
the second's: the aim is >= 5x for a 1,000-token system prompt), whether
every output equals the uncached run's, and both caches' lookups, hit rate
and saved prefill tokens. One warm-up request on an unrelated prompt runs
first on both stacks (not timed, its blocks dropped).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from specdec.bench.report import cache_lines
from specdec.bench.runner import SPECULATIVE, BenchConfig, device_name, method_tree
from specdec.bench.suite import Models, prefix_record
from specdec.local import generate
from specdec.request.decoding import StopCriteria


def system_prompt(tokenizer, texts: Sequence[str], tokens: int) -> list[int]:
    """``tokens`` token ids of the prompts' text, concatenated (repeated as needed)."""
    ids: list[int] = []
    while len(ids) < tokens:
        for text in texts:
            ids += tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[:tokens]


def run_prefix_bench(cfg: BenchConfig, texts: Sequence[str], system_tokens: int, requests: int,
                     cache_tokens: int, progress: Callable[[str], None] | None = None) -> dict:
    """The JSON record of ``specdec bench prefix`` (module doc); ``cfg.methods[0]``
    is the method (vanilla or a speculative one)."""
    method = cfg.methods[0]
    cached, plain = Models(replace(cfg, prefix_cache_tokens=cache_tokens)), Models(replace(cfg, prefix_cache_tokens=0))
    user = [cached.encode([t])[0].ids for t in texts]
    system = system_prompt(cached.tokenizer, [t for t in texts if isinstance(t, str)], system_tokens)
    tree = method_tree(method, cfg.tree) if method in SPECULATIVE else None
    drafters = {name: models.drafter(SPECULATIVE[method][0]) if tree is not None else None
                for name, models in (("cached", cached), ("plain", plain))}
    stop = StopCriteria(max_new_tokens=cfg.max_new_tokens, eos_ids=cached.eos_ids)

    def run(name: str, prompt: list[int]):
        models = cached if name == "cached" else plain
        return generate(models.verifier, drafters[name], prompt, cfg.params, stop, tree)

    warm = torch.randint(1, cached.target.vocab_size, (system_tokens,), generator=torch.Generator().manual_seed(0))
    for name in ("plain", "cached"):
        run(name, warm.tolist())
    for cache in [cached.verifier.prefix.blocks] + ([drafters["cached"].prefix] if drafters["cached"] else []):
        cache.reset()                        # the warm-up's blocks and counts go
    rows = []
    for i in range(requests):
        prompt = system + user[i % len(user)]
        base, got = run("plain", prompt), run("cached", prompt)
        rows.append({"prompt_tokens": len(prompt), "ttft_s": round(got.stats.ttft_s, 5),
                     "uncached_ttft_s": round(base.stats.ttft_s, 5), "wall_s": round(got.stats.wall_s, 4),
                     "uncached_wall_s": round(base.stats.wall_s, 4), "identical": got.tokens == base.tokens})
        if progress is not None:
            progress(f"request {i + 1}/{requests}: time to first token {got.stats.ttft_s * 1e3:.1f} ms "
                     f"(uncached {base.stats.ttft_s * 1e3:.1f} ms)")
    warm_ttft = [r["ttft_s"] for r in rows[1:]]
    return {
        "device": device_name(cfg.device), "target": cfg.target, "method": method, "compile": cfg.compile,
        "temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens, "system_tokens": system_tokens,
        "prefix_cache_tokens": cache_tokens, "exact": cfg.prefix_cache_exact, "requests": rows,
        "first_ttft_s": rows[0]["ttft_s"],
        "second_ttft_s": rows[1]["ttft_s"] if len(rows) > 1 else None,
        "first_over_second": round(rows[0]["ttft_s"] / rows[1]["ttft_s"], 2) if len(rows) > 1 else None,
        "warm_ttft_median_s": round(statistics.median(warm_ttft), 5) if warm_ttft else None,
        "uncached_ttft_median_s": round(statistics.median(r["uncached_ttft_s"] for r in rows), 5),
        "outputs_identical": all(r["identical"] for r in rows),
        "prefix_cache": prefix_record(replace(cfg, prefix_cache_tokens=cache_tokens), cached),
    }


def prefix_markdown(result: dict) -> str:
    ratio = result["first_over_second"]
    lines = [
        "# specdec bench prefix",
        "",
        f"- device: {result['device']}; target: `{result['target']}`; method {result['method']}; "
        f"compile {result['compile']}; temperature {result['temperature']}; "
        f"max_new_tokens {result['max_new_tokens']}",
        f"- a shared system prompt of {result['system_tokens']} tokens + each request's own prompt; "
        f"prefix cache {result['prefix_cache_tokens']} tokens"
        + (", exact (block-aligned prefill chunks)" if result.get("exact") else ""),
        "",
        f"- time to first token, first request (cold cache): {result['first_ttft_s'] * 1e3:.1f} ms",
    ]
    if ratio is not None:
        lines += [f"- time to first token, second request: {result['second_ttft_s'] * 1e3:.1f} ms "
                  f"(**{ratio:.1f}x** faster); median of the warm requests "
                  f"{result['warm_ttft_median_s'] * 1e3:.1f} ms"]
    lines += [f"- without the cache (median): {result['uncached_ttft_median_s'] * 1e3:.1f} ms",
              f"- outputs identical to the uncached engines': {'yes' if result['outputs_identical'] else 'NO'}"]
    lines += cache_lines(result["prefix_cache"])
    lines += ["", "| request | prompt tokens | TTFT ms | uncached TTFT ms | identical |", "|---|---|---|---|---|"]
    for i, r in enumerate(result["requests"], 1):
        lines.append(f"| {i} | {r['prompt_tokens']} | {r['ttft_s'] * 1e3:.1f} | {r['uncached_ttft_s'] * 1e3:.1f} "
                     f"| {'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines) + "\n"

