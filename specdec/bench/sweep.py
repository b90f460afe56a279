"""Tree budget sweep: tau and tokens/s of eagle2 over the tree size and depth.

On a GPU a target forward over 60 tree tokens costs about as much as over one,
so the EAGLE-2 reference drafts 48-60 tokens; on a CPU the verify cost grows
with the tree (DESIGN.md §4) and a smaller tree wins. The sweep measures both
axes with the other knob fixed:

- total_tokens in SWEEP_TOTALS at the configured depth;
- depth in SWEEP_DEPTHS at the configured total_tokens;

every point interleaved with the others and with vanilla on each prompt (the
protocol of ``specdec.bench.runner``). ``best`` is the point of highest
tokens/s: the data behind the CPU defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from specdec.bench.runner import SWEEP_DEPTHS, SWEEP_TOTALS, BenchConfig, device_name, measure
from specdec.bench.suite import Models
from specdec.request.params import TreeParams


def _key(tree: TreeParams) -> str:
    return f"eagle2[total={tree.total_tokens},depth={tree.depth},k={tree.expand_k}]"


def sweep_points(base: TreeParams, totals: Sequence[int] = SWEEP_TOTALS,
                 depths: Sequence[int] = SWEEP_DEPTHS) -> tuple[list[TreeParams], list[TreeParams]]:
    """(points over total_tokens at base.depth, points over depth at base.total_tokens)."""
    base = replace(base, method="eagle2")
    return ([replace(base, total_tokens=t) for t in totals], [replace(base, depth=d) for d in depths])


def run_sweep(cfg: BenchConfig, texts: Sequence[str], totals: Sequence[int] = SWEEP_TOTALS,
              depths: Sequence[int] = SWEEP_DEPTHS, progress: Callable[[str], None] | None = None) -> dict:
    by_total, by_depth = sweep_points(cfg.tree, totals, depths)
    deepest = max(t.depth for t in by_total + by_depth)
    models = Models(replace(cfg, tree=replace(cfg.tree, depth=deepest)))   # context check at the deepest tree
    prompts = models.encode(texts)
    methods = {"vanilla": models.local("vanilla")}
    for tree in by_total + by_depth:                 # the point both axes share runs once
        methods.setdefault(_key(tree), models.local("eagle2", tree=tree))
    if models.target.compiled is not None:     # no graph built or opened while timed
        models.target.compile_trees(max(t.total_tokens for t in by_total + by_depth))
        models.target.compiled.open_all()
    totals_by_name = measure(methods, prompts, cfg.repeats, cfg.seed, progress=progress)
    vanilla = totals_by_name["vanilla"].tokens_per_s

    def point(tree: TreeParams) -> dict:
        tot = totals_by_name[_key(tree)]
        tau, _ = tot.cycle_stats()
        tps = tot.tokens_per_s
        return {"total_tokens": tree.total_tokens, "depth": tree.depth, "expand_k": tree.expand_k,
                "tau": None if tau is None else round(tau, 4), "tokens_per_s": round(tps, 3),
                "speedup_vs_vanilla": round(tps / vanilla, 4) if vanilla > 0 else None}

    over_total, over_depth = [point(t) for t in by_total], [point(t) for t in by_depth]
    best = max(over_total + over_depth, key=lambda p: p["tokens_per_s"])
    return {
        "device": device_name(cfg.device),
        "target": cfg.target,
        "temperature": float(cfg.temperature),
        "prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens,
        "repeats": cfg.repeats,
        "fixed": {"total_tokens": cfg.tree.total_tokens, "depth": cfg.tree.depth, "expand_k": cfg.tree.expand_k},
        "vanilla_tokens_per_s": round(vanilla, 3),
        "total_tokens": over_total,
        "depth": over_depth,
        "best": best,
        "best_total_tokens": max(over_total, key=lambda p: p["tokens_per_s"])["total_tokens"],
        "best_depth": max(over_depth, key=lambda p: p["tokens_per_s"])["depth"],
    }


def sweep_markdown(sweep: dict) -> str:
    fixed, best = sweep["fixed"], sweep["best"]

    def table(rows: list[dict], knob: str) -> list[str]:
        out = [f"| {knob} | τ | tokens/s | speedup vs vanilla |", "|---:|---:|---:|---:|"]
        for r in rows:
            mark = " **best**" if r == best else ""
            tau = "–" if r["tau"] is None else f"{r['tau']:.2f}"
            out.append(f"| {r[knob]}{mark} | {tau} | {r['tokens_per_s']:.1f} | {r['speedup_vs_vanilla'] or 0:.2f}x |")
        return out

    return "\n".join([
        "# specdec bench: tree budget sweep (eagle2)",
        "",
        f"- device: {sweep['device']}",
        f"- target: `{sweep['target']}`; temperature {sweep['temperature']}, prompts {sweep['prompts']}, "
        f"max_new_tokens {sweep['max_new_tokens']}; vanilla {sweep['vanilla_tokens_per_s']:.1f} tokens/s",
        f"- highest tokens/s: total_tokens {best['total_tokens']}, depth {best['depth']}, expand_k "
        f"{best['expand_k']} ({best['tokens_per_s']:.1f} tokens/s, τ {best['tau'] or 0:.2f}, "
        f"{best['speedup_vs_vanilla'] or 0:.2f}x vanilla)",
        "",
        f"## total_tokens (depth {fixed['depth']}, expand_k {fixed['expand_k']})",
        "",
        *table(sweep["total_tokens"], "total_tokens"),
        "",
        f"## depth (total_tokens {fixed['total_tokens']}, expand_k {fixed['expand_k']})",
        "",
        *table(sweep["depth"], "depth"),
        "",
        "![sweep](sweep.png)",
        "",
    ])


def plot_sweep(sweep: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), dpi=110)
    axes = fig.subplots(1, 2)
    fixed = sweep["fixed"]
    for ax, knob, note in ((axes[0], "total_tokens", f"depth {fixed['depth']}"),
                           (axes[1], "depth", f"total_tokens {fixed['total_tokens']}")):
        rows = sweep[knob]
        xs = [r[knob] for r in rows]
        ax.plot(xs, [r["tokens_per_s"] for r in rows], marker="o", color="#2b6cb0", label="tokens/s")
        ax.axhline(sweep["vanilla_tokens_per_s"], color="#8c8c8c", ls="--", lw=0.8, label="vanilla tokens/s")
        ax.set_xlabel(f"{knob} ({note})")
        ax.set_ylabel("tokens/s", color="#2b6cb0")
        twin = ax.twinx()
        twin.plot(xs, [r["tau"] or 0 for r in rows], marker="s", color="#e08a2c", label="τ")
        twin.set_ylabel("τ (bonus token included)", color="#e08a2c")
        ax.set_xticks(xs)
        handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        twin.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="best")   # on top of both axes
    fig.suptitle(f"eagle2 tree budget sweep: {sweep['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


def write_sweep_report(sweep: dict, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, png = out / "sweep.md", out / "sweep.png"
    md.write_text(sweep_markdown(sweep))
    plot_sweep(sweep, png)
    return [md, png]
