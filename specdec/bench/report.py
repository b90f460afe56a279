"""Paper-style report of a ``specdec bench`` run: a markdown table (the EAGLE-2
paper's Tables 1 and 3: speedup and tau per method) and PNG plots (Figure 1/2:
speedup per method; Figure 5: acceptance per draft position; Figure 6:
draft confidence vs acceptance rate). A ``--concurrency`` run gets its own
table (per level and method: aggregate tokens/s, speedup, latency
percentiles) and concurrency.png (aggregate tokens/s vs C). Plots use
matplotlib's Agg canvas directly, so no display and no global pyplot state
are involved.
"""

from __future__ import annotations

from pathlib import Path

from specdec.bench.runner import GRPC_SUFFIX, OPENAI_METHOD, PEER_METHODS, REFERENCES

# bar colours by family: references grey, external peers orange, ours blue
_COLOURS = {"reference": "#8c8c8c", "peer": "#e08a2c", "ours": "#2b6cb0", "grpc": "#7fb3e6"}


def _gate(tree: dict) -> str:
    t, ahead = tree.get("min_tau", 0), tree.get("lookahead")
    if t is None:           # by drafter kind
        from specdec.request.knobs import DEFAULT_MIN_TAU, NGRAM_MIN_TAU

        t = f"{DEFAULT_MIN_TAU:g} ({NGRAM_MIN_TAU:g} for n-gram)"
    elif t:
        t = f"{t:g}"
    out = (f"; drafting paused while a session's recent τ < {t} (`--min-tau`; τ counts those root-only "
           f"cycles too)") if t else ""
    if ahead:
        out += ("; METHOD@grpc-aheadN: an orchestrator that drafts one round ahead for N accepted paths "
                "(`--lookahead`; the share of cycles whose tree was ready in the table)")
    return out

def family(name: str) -> str:
    if GRPC_SUFFIX in name:
        return "grpc"
    if name in REFERENCES:
        return "reference"
    return "peer" if name in PEER_METHODS or name == OPENAI_METHOD else "ours"


def _fmt(x, spec: str, none: str = "–") -> str:
    return none if x is None else format(x, spec)


def _yes_no(x) -> str:
    return "n/a" if x is None else ("yes" if x else "**NO**")


def results_table(result: dict) -> str:
    """One row per method: speedups, tau, tokens/s, output check, time split
    (and, when the services drafted ahead, the share of cycles that hit)."""
    ahead = bool((result.get("tree") or {}).get("lookahead"))
    lines = ["| method | speedup vs vanilla | speedup vs hf-generate | τ | tokens/s | matches vanilla "
             "| draft / verify / network / other |" + (" ahead hits | τ hit / fresh |" if ahead else ""),
             "|---|---:|---:|---:|---:|:---:|---|" + ("---:|---:|" if ahead else "")]
    for name, m in result["methods"].items():
        ts = m["time_split"]
        split = " / ".join(_fmt(ts.get(f"{k}_frac"), ".0%") for k in ("draft", "verify", "network", "other"))
        row = (f"| {name} | {_fmt(m['speedup_vs_vanilla'], '.2f')}x | {_fmt(m['speedup_vs_hf_generate'], '.2f')}x "
               f"| {_fmt(m['tau'], '.2f')} | {_fmt(m['tokens_per_s'], '.1f')} | {_yes_no(m['matches_vanilla'])} "
               f"| {split} |")
        if ahead:
            row += (f" {_fmt(m.get('ahead_hit_rate'), '.0%')} | {_fmt(m.get('ahead_tau_hit'), '.2f')} / "
                    f"{_fmt(m.get('ahead_tau_fresh'), '.2f')} |")
        lines.append(row)
    return "\n".join(lines)


def cycle_table(result: dict) -> str:
    """Milliseconds per draft/verify cycle, split (prefills spread over the
    cycles); through the services also the bytes on the wire and, drafting
    ahead, the drafter's time spent on it, per cycle."""
    rows = {n: m for n, m in result["methods"].items() if m["time_split"].get("per_cycle_ms")}
    lines = ["| method | wall | draft | verify | network | other | bytes | drafting ahead |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in rows.items():
        ms = m["time_split"]["per_cycle_ms"]
        cells = [f"{ms[k]:.2f}" for k in ("wall", "draft", "verify", "network", "other")]
        cells += [_fmt(m.get("wire_bytes_per_cycle"), ".0f"), _fmt(m.get("ahead_draft_ms_per_cycle"), ".2f")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def acceptance_table(result: dict) -> str:
    rows = {n: m["accepted_per_position"] for n, m in result["methods"].items() if m["accepted_per_position"]}
    if not rows:
        return "_no draft token was accepted by any method_"
    width = max(map(len, rows.values()))
    lines = ["| method | " + " | ".join(f"≥{j + 1}" for j in range(width)) + " |",
             "|---|" + "---:|" * width]
    for name, rates in rows.items():
        cells = [f"{r:.2f}" for r in rates] + [""] * (width - len(rates))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _sizing(sizing: dict | None) -> list[str]:
    """The tree sizing line: its mode and, when by cost, the verify costs it measured."""
    if not sizing:
        return []
    costs = ", ".join(f"{w}: {ms:.2f}" for w, ms in sizing.get("verify_ms", {}).items())
    cost = ("cost (greedy trees cut per cycle to the size whose expected tokens best repay its verify time; "
            f"measured verify ms per width {{{costs}}})")
    fixed = "fixed (every tree verified as drafted)"
    mode, other = (cost, "fixed") if sizing.get("mode") == "cost" else (fixed, "cost")
    compared = f"; METHOD@{other}: {cost if other == 'cost' else fixed}" if sizing.get("compared") else ""
    return [f"- tree sizing: {mode}{compared}"]


def calibration_table(calibration: dict) -> str:
    lines = ["| confidence | nodes | accepted | acceptance rate |", "|---|---:|---:|---:|"]
    for b in calibration["bins"]:
        if b["nodes"]:
            lines.append(f"| {b['lo']:.2f}–{b['hi']:.2f} | {b['nodes']} | {b['accepted']} | {b['rate']:.2f} |")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    tree = result.get("tree", {})
    cal = result.get("calibration")
    parts = [
        "# specdec bench",
        "",
        f"- device: {result['device']}",
        f"- target: `{result['target']}`"
        + (f"; compiled forwards: `--compile {result['compile']}`" if result.get("compile") else "")
        + (f"; weights: `--weights {result['weights']}`" if result.get("weights", "dtype") != "dtype" else ""),
        f"- temperature: {result['temperature']}, prompts: {result['prompts']}, "
        f"max_new_tokens: {result['max_new_tokens']}, repeats: {result.get('repeats', 1)}",
        f"- tree: total_tokens {tree.get('total_tokens')}, depth {tree.get('depth')}, expand_k {tree.get('expand_k')}"
        + _gate(tree),
        *_sizing(result.get("tree_sizing")),
        "- τ = tokens committed per draft/verify cycle, **bonus token included** (vanilla: 1.00); "
        "– where a peer does not expose its cycles",
        "- methods interleaved per prompt (order rotated), one warm-up per method excluded",
        *(["- pinned: verifier and drafter processes on one core each, one torch thread each; in-process "
           "methods on the verifier's core"] if result.get("pinned") else []),
        *cache_lines(result.get("prefix_cache")),
        *[f"- **{note}**" for note in result.get("notes", []) if note.startswith("WARNING")],
        "",
        "## Speed and acceptance length",
        "",
        results_table(result),
        "",
        "![speedup](speedup.png)",
        "",
        "## Time per cycle (ms)",
        "",
        "Network: each backend call's wall time minus the compute its backend reports "
        "(transport, serialization, queueing); bytes: the orchestrator's backend calls, serialized, "
        "requests and answers; drafting ahead: the drafter's compute on it (hidden behind the verify).",
        "",
        cycle_table(result),
        "",
        "## Acceptance per draft position",
        "",
        "Fraction of cycles that accepted at least j draft tokens.",
        "",
        acceptance_table(result),
        "",
        "![acceptance per position](acceptance_per_position.png)",
        "",
    ]
    llama = result.get("llamacpp") or {}
    notes = [f"- {note}" for note in llama.get("notes", [])] + [
        f"- {name}: {frac:.0%} of generations token-identical to vanilla"
        for name, frac in (llama.get("identical_to_vanilla") or {}).items()]
    parts += notes + [""] if notes else []
    if cal is not None:
        parts += [
            f"## Calibration ({cal['method']}): draft confidence vs acceptance",
            "",
            f"{cal['evaluated_nodes']} evaluated draft nodes (parent accepted or root); confidence = the draft "
            "probability of a node given its parent, in bins 0.05 wide.",
            "",
            calibration_table(cal),
            "",
            "![calibration](calibration.png)",
            "",
        ]
    return "\n".join(parts)


# -- plots --------------------------------------------------------------------------
def _figure(width: float = 7.0, height: float = 4.0):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=110)


def plot_speedup(result: dict, path: Path) -> None:
    names = list(result["methods"])
    speed = [result["methods"][n]["speedup_vs_vanilla"] or 0.0 for n in names]
    fig = _figure(max(6.0, 0.65 * len(names) + 2), 4.2)
    ax = fig.add_subplot()
    bars = ax.bar(range(len(names)), speed, color=[_COLOURS[family(n)] for n in names])
    for bar, s in zip(bars, speed):
        ax.annotate(f"{s:.2f}x", (bar.get_x() + bar.get_width() / 2, s), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("speedup vs vanilla")
    ax.set_title(f"specdec bench, T={result['temperature']:g}: {result['device']}", fontsize=9)
    ax.set_ylim(0, max(speed + [1.0]) * 1.18)
    from matplotlib.patches import Patch

    seen = dict.fromkeys(family(n) for n in names)
    labels = {"reference": "reference", "peer": "transformers peer", "ours": "specdec (in-process)",
              "grpc": "specdec (gRPC)"}
    ax.legend([Patch(color=_COLOURS[f]) for f in seen], [labels[f] for f in seen], fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)


def plot_acceptance(result: dict, path: Path) -> None:
    fig = _figure()
    ax = fig.add_subplot()
    for name, m in result["methods"].items():
        rates = m["accepted_per_position"]
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", ms=3, label=name)
    ax.set_xlabel("draft position j")
    ax.set_ylabel("fraction of cycles accepting ≥ j tokens")
    ax.set_ylim(0, 1.02)
    ax.set_title("acceptance per draft position", fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)


def plot_calibration(calibration: dict, path: Path) -> None:
    fig = _figure(5.0, 4.6)
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1], color="black", lw=0.8, ls="--", label="perfect calibration")
    bins = [b for b in calibration["bins"] if b["nodes"]]
    if bins:
        bars = ax.bar([b["lo"] for b in bins], [b["rate"] for b in bins], width=[b["hi"] - b["lo"] for b in bins],
                      align="edge", color=_COLOURS["ours"], alpha=0.8, edgecolor="white",
                      label=f"{calibration['method']} ({calibration['evaluated_nodes']} nodes)")
        for bar, b in zip(bars, bins):
            ax.annotate(str(b["nodes"]), (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=6, xytext=(0, 1), textcoords="offset points")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("draft confidence")
    ax.set_ylabel("acceptance rate")
    ax.set_title("draft confidence vs acceptance (bins 0.05; nodes per bin on top)", fontsize=9)
    ax.legend(fontsize=8, frameon=False, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)


def write_report(result: dict, out_dir: str | Path) -> list[Path]:
    """results.md, speedup.png, acceptance_per_position.png, calibration.png."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.md", out / "speedup.png", out / "acceptance_per_position.png"]
    paths[0].write_text(markdown(result))
    plot_speedup(result, paths[1])
    plot_acceptance(result, paths[2])
    if result.get("calibration") is not None:
        paths.append(out / "calibration.png")
        plot_calibration(result["calibration"], paths[-1])
    return paths


# -- --concurrency -------------------------------------------------------------------
def concurrency_table(result: dict) -> str:
    """One row per (C, method): throughput, speedup and scaling, tau, latency, output check."""
    lowest = result["levels"][0]
    lines = [f"| C | method | aggregate tokens/s | vs vanilla | vs C={lowest} | τ | latency p50 / p90 / p99 (s) "
             "| TTFT p50 / p90 (s) | matches vanilla |",
             "|---:|---|---:|---:|---:|---:|---|---|:---:|"]
    for c in map(str, result["levels"]):
        for name, levels in result["concurrency"].items():
            m = levels[c]
            lat, ttft = m["latency_s"], m["ttft_s"]
            lines.append(
                f"| {c} | {name} | {_fmt(m['aggregate_tokens_per_s'], '.1f')} "
                f"| {_fmt(m['speedup_vs_vanilla'], '.2f')}x | {_fmt(m['scaling'], '.2f')}x | {_fmt(m['tau'], '.2f')} "
                f"| {' / '.join(_fmt(lat[k], '.3f') for k in ('p50', 'p90', 'p99'))} "
                f"| {' / '.join(_fmt(ttft[k], '.3f') for k in ('p50', 'p90'))} | {_yes_no(m['matches_vanilla'])} |")
    return "\n".join(lines)


def concurrency_markdown(result: dict) -> str:
    tree = result.get("tree", {})
    return "\n".join([
        "# specdec bench --concurrency",
        "",
        f"- device: {result['device']}",
        f"- target: `{result['target']}`",
        f"- temperature: {result['temperature']}, prompts: {result['prompts']} (cycled), "
        f"max_new_tokens: {result['max_new_tokens']}, requests per level: {result['requests_per_level']}, "
        f"repeats: {result.get('repeats', 1)}",
        f"- tree: total_tokens {tree.get('total_tokens')}, depth {tree.get('depth')}, expand_k {tree.get('expand_k')}"
        + _gate(tree) + (f"; verify token budget {tree['verify_token_budget']} (each session's tree cut to budget / sessions, "
           f"at least 4)" if tree.get("verify_token_budget") else ""),
        "- C requests in flight at a time through the orchestrator, drafter and verifier services; "
        "vanilla = method VANILLA on the same services",
        "- aggregate tokens/s = all requests' tokens / pool wall time; latency and TTFT measured at the client",
        "- τ counts the bonus token; matches vanilla: tokens equal vanilla's at the lowest C",
        "",
        "## Aggregate throughput and latency vs concurrency",
        "",
        concurrency_table(result),
        "",
        "![aggregate tokens/s vs concurrency](concurrency.png)",
        "",
    ])


def plot_concurrency(result: dict, path: Path) -> None:
    levels = result["levels"]
    fig = _figure()
    ax = fig.add_subplot()
    for name, by_level in result["concurrency"].items():
        tps = [by_level[str(c)]["aggregate_tokens_per_s"] for c in levels]
        colour = _COLOURS["reference"] if name in REFERENCES else None
        ax.plot(levels, tps, marker="o", ms=4, label=name, color=colour)
        for c, t in zip(levels, tps):
            ax.annotate(f"{t:.0f}", (c, t), ha="center", va="bottom", fontsize=7, xytext=(0, 3),
                        textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.minorticks_off()
    ax.set_xlabel("concurrent requests C")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_ylim(0, None)
    ax.set_title(f"aggregate throughput vs concurrency, T={result['temperature']:g}: {result['device']}",
                 fontsize=9)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)


def write_concurrency_report(result: dict, out_dir: str | Path) -> list[Path]:
    """results.md and concurrency.png of a ``--concurrency`` run."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.md", out / "concurrency.png"]
    paths[0].write_text(concurrency_markdown(result))
    plot_concurrency(result, paths[1])
    return paths


def cache_lines(record: dict | None) -> list[str]:
    """Markdown lines of a ``prefix_record`` (none when the caches were off)."""
    lines = []
    for name, c in (record or {}).items():
        rate = "–" if c["hit_rate"] is None else f"{c['hit_rate']:.0%}"
        lines.append(f"- {name} prefix cache: {c['lookups']} lookups, hit rate {rate}, "
                     f"{c['saved_prefill_tokens']} prefill tokens saved, {c['cached_tokens']} tokens held")
    return lines
