"""Benchmark runner: every method on the same prompts, interleaved, in one process.

Measurement protocol (issue 5; the EAGLE-2 paper reports speedup and the
average acceptance length tau the same way in its Tables 1-3):
- every method generates for every prompt; for each prompt the methods run one
  after another, in an order rotated from one prompt to the next
  (``schedule``), so slow drifts of a shared machine hit all methods alike;
- one warm-up generation per method before timing (first-call allocations,
  lazy initialisation), excluded from every figure;
- stop rule as in real use: EOS or max_new_tokens. Greedy methods are lossless,
  so they all produce the same tokens and the same count;
- tokens/s = generated tokens / wall time of the generate calls (prefill
  included), summed over prompts and repeats;
- tau = tokens committed per draft/verify cycle, *bonus token included*
  (vanilla: 1.0); accepted_per_position[j] = fraction of cycles that accepted
  at least j+1 draft tokens (the paper's Figure 5 counts the same thing);
- time split: draft = all drafter work (prefill, commit, draft), verify = all
  target work (prefill, verify), network = time in transit (gRPC only),
  other = the rest of the wall time (loop bookkeeping, tokenizer, client).
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from specdec.procs import STARTUP_TIMEOUT_S
from specdec.request.decoding import StopCriteria
from specdec.request.lookahead import LookaheadParams
from specdec.request.params import SamplingParams
from specdec.request.params import TreeParams

REFERENCES = ("vanilla", "hf-generate")
# speculative method -> (drafter kind, tree method)
SPECULATIVE = {
    "chain": ("eagle", "chain"),
    "static": ("eagle", "static"),
    "eagle2": ("eagle", "eagle2"),
    "no-value": ("eagle", "no-value"),
    "no-rerank": ("eagle", "no-rerank"),
    "ngram": ("ngram", "eagle2"),
    "sps": ("draft-lm", "chain"),          # classic speculative sampling with the draft LM (opt-in)
    "eagle2-top": ("eagle", "eagle2"),     # eagle2 with top-k proposals also when sampling (opt-in)
    "eagle3": ("eagle3", "eagle2"),        # EAGLE-2 dynamic trees drafted by an EAGLE-3 head (opt-in: --eagle3)
    "medusa": ("medusa", "eagle2"),        # EAGLE-2 dynamic trees over Medusa heads' log-probs (opt-in: --medusa)
    "medusa-static": ("medusa", "static"),  # Medusa's static tree, mc_sim_7b_63 cut to the budget (opt-in)
    "hydra": ("hydra", "eagle2"),          # EAGLE-2 dynamic trees over Hydra heads, path by path (opt-in: --hydra)
    "hydra-static": ("hydra", "static"),   # Hydra heads in Medusa's static tree (opt-in)
    "lookahead": ("lookahead", "lookahead"),  # lookahead decoding: the verifier drafts, no drafter (opt-in)
}
SELF_DRAFTED = ("lookahead",)              # drafter kinds with no drafter: the verifier drafts the trees
TOP_PROPOSALS = ("eagle2-top",)            # methods that always propose the draft's top tokens
# opt-in: the llama.cpp peer (bench.llamacpp_peer): on the f32 export, its prompt lookup, on the GGUF file served,
# on the Q8_0 export (the 8-bit peer of --weights int8)
LLAMACPP_METHODS = ("llamacpp", "llamacpp-lookup", "llamacpp-gguf", "llamacpp-q8")
PEER_METHODS = ("hf-generate", "hf-assisted", "hf-prompt-lookup") + LLAMACPP_METHODS
DEFAULT_METHODS = ("vanilla", "hf-generate", "hf-assisted", "hf-prompt-lookup",
                   "chain", "static", "eagle2", "no-value", "no-rerank", "ngram")
ALL_METHODS = DEFAULT_METHODS + ("sps", "eagle2-top", "eagle3", "medusa", "medusa-static", "hydra",
                                 "hydra-static", "lookahead") + LLAMACPP_METHODS
GRPC_SUFFIX = "@grpc"
AHEAD_SUFFIX = "-ahead"          # METHOD@grpc-aheadN: through an orchestrator with --lookahead N
UNARY_SUFFIX = "-unary"          # METHOD@grpc-unary: through an orchestrator with --unary-steps
RELAY_SUFFIX = "-relay"          # METHOD@grpc[-aheadN]-relay: through an orchestrator with --plane relay
SWEEP_TOTALS = (8, 12, 16, 24, 32, 48, 60)     # `bench sweep`: total_tokens at the configured depth
SWEEP_DEPTHS = (2, 3, 4, 5, 6, 7, 8)           # and depths at the configured total_tokens
OPENAI_METHOD = "openai"         # with --openai-url: that OpenAI-compatible server (bench.openai_peer)
CALIBRATED = "eagle2"                      # the method whose trees feed the calibration plot


@dataclass(frozen=True)
class Prompt:
    text: str
    ids: list[int]


@dataclass
class Sample:
    """One timed generation."""

    tokens: list[int]
    wall_s: float
    cycles: int | None = None              # None: a peer whose cycles are not visible
    committed: int = 0                     # tokens committed by cycles (bonus included)
    accepted_counts: list[int] = field(default_factory=list)   # [j]: cycles with >= j+1 accepted
    draft_s: float | None = None
    verify_s: float | None = None
    network_s: float | None = None
    ahead_hits: int = 0                    # cycles whose tree was drafted one round ahead (services)
    wire_bytes: int = 0                    # bytes of the orchestrator's backend calls (services)
    ahead_draft_s: float = 0.0             # drafter compute drafting ahead (services)
    ahead_committed: int = 0               # tokens the cycles with a tree drafted ahead committed (services)


class Method(Protocol):
    def run(self, prompt: Prompt, seed: int | None) -> Sample: ...


@dataclass(frozen=True)
class Slot:
    repeat: int
    prompt: int
    method: str


def schedule(methods: Sequence[str], n_prompts: int, repeats: int = 1) -> list[Slot]:
    """Every (repeat, prompt, method), prompts in order and, within a prompt, the
    methods rotated by one place per prompt: each method leads equally often."""
    out, m = [], len(methods)
    for r in range(repeats):
        for p in range(n_prompts):
            shift = (r * n_prompts + p) % m if m else 0
            out += [Slot(r, p, name) for name in (*methods[shift:], *methods[:shift])]
    return out


# -- in-process methods ----------------------------------------------------------
class LocalMethod:
    """The speculative loop in-process (``specdec.local.generate``): vanilla with no drafter / tree."""

    def __init__(self, verifier, drafter, tree: TreeParams | None, params: SamplingParams, stop: StopCriteria,
                 min_tau: float = 0.0, min_tau_prior: bool = False):
        self.verifier, self.drafter, self.tree, self.params, self.stop = verifier, drafter, tree, params, stop
        self.min_tau, self.min_tau_prior = min_tau, min_tau_prior

    def run(self, prompt: Prompt, seed: int | None) -> Sample:
        from specdec.local import generate

        params = self.params if self.params.greedy else replace(self.params, seed=seed)
        t = time.perf_counter()
        dec = generate(self.verifier, self.drafter, prompt.ids, params, self.stop, self.tree, self.min_tau,
                       min_tau_prior=self.min_tau_prior)
        wall = time.perf_counter() - t
        s, ts = dec.stats, dec.stats.time_s
        return Sample(tokens=list(dec.tokens), wall_s=wall, cycles=s.cycles, committed=sum(s.committed_per_cycle),
                      accepted_counts=list(s.accepted_per_position), draft_s=ts["draft"] + ts["commit"],
                      verify_s=ts["prefill"] + ts["verify"], network_s=0.0)


class PinnedMethod:
    """``method`` run with the calling thread (which runs a one-thread torch
    forward itself) allowed only on ``cores``; as before afterwards."""

    def __init__(self, method: Method, cores: frozenset[int]):
        self.method, self.cores = method, cores

    def run(self, prompt: Prompt, seed: int | None) -> Sample:
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, self.cores)
        try:
            return self.method.run(prompt, seed)
        finally:
            os.sched_setaffinity(0, before)


# -- aggregation -------------------------------------------------------------------
@dataclass
class Totals:
    """All timed samples of one method."""

    samples: dict[tuple[int, int], Sample] = field(default_factory=dict)   # (repeat, prompt) -> sample

    def add(self, slot: Slot, sample: Sample) -> None:
        self.samples[(slot.repeat, slot.prompt)] = sample

    @property
    def tokens(self) -> int:
        return sum(len(s.tokens) for s in self.samples.values())

    @property
    def wall_s(self) -> float:
        return sum(s.wall_s for s in self.samples.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def cycle_stats(self) -> tuple[float | None, list[float]]:
        """(tau, acceptance rate per position), None / [] for peers."""
        samples = list(self.samples.values())
        if not samples or any(s.cycles is None for s in samples):
            return None, []
        cycles = sum(s.cycles for s in samples)
        if cycles == 0:
            return None, []
        counts: list[int] = []
        for s in samples:
            counts += [0] * (len(s.accepted_counts) - len(counts))
            for j, c in enumerate(s.accepted_counts):
                counts[j] += c
        return sum(s.committed for s in samples) / cycles, [c / cycles for c in counts]

    def ahead_hit_rate(self) -> float | None:
        """Share of cycles whose tree was drafted one round ahead; None without cycles."""
        cycles = sum(s.cycles or 0 for s in self.samples.values())
        return sum(s.ahead_hits for s in self.samples.values()) / cycles if cycles else None

    def ahead_tau(self) -> tuple[float | None, float | None]:
        """τ of the cycles whose tree was drafted ahead, and of the others (None: no such cycle)."""
        samples = self.samples.values()
        cycles, hits = sum(s.cycles or 0 for s in samples), sum(s.ahead_hits for s in samples)
        committed, ahead = sum(s.committed for s in samples), sum(s.ahead_committed for s in samples)
        return (ahead / hits if hits else None,
                (committed - ahead) / (cycles - hits) if cycles > hits else None)

    def per_cycle(self, attr: str) -> float | None:
        """A Sample figure summed over the samples, per cycle; None without cycles."""
        cycles = sum(s.cycles or 0 for s in self.samples.values())
        return sum(getattr(s, attr) for s in self.samples.values()) / cycles if cycles else None

    def time_split(self) -> dict:
        wall = self.wall_s
        parts = {}
        for name in ("draft", "verify", "network"):
            vals = [getattr(s, f"{name}_s") for s in self.samples.values()]
            parts[name] = None if not vals or any(v is None for v in vals) else sum(vals)
        known = None if any(v is None for v in parts.values()) else sum(parts.values())
        parts["other"] = None if known is None else max(0.0, wall - known)
        out = {f"{k}_s": _round(v, 6) for k, v in parts.items()}
        out["wall_s"] = _round(wall, 6)
        out.update({f"{k}_frac": _round(v / wall if wall > 0 else None, 4) if v is not None else None
                    for k, v in parts.items()})
        cycles = sum(s.cycles or 0 for s in self.samples.values())
        if cycles and parts["other"] is not None:
            # one cycle's time (prefills spread over the cycles), the per-cycle RPC cost among it
            out["per_cycle_ms"] = {k: round(v * 1e3 / cycles, 3) for k, v in (*parts.items(), ("wall", wall))}
        return out

    def outputs(self) -> dict[tuple[int, int], list[int]]:
        return {key: s.tokens for key, s in self.samples.items()}


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(float(x), digits)


def matches(outputs: dict, reference: dict) -> bool:
    """Token-identical to the reference for every (repeat, prompt)."""
    return bool(reference) and all(outputs.get(key) == want for key, want in reference.items())


def summarize(totals: dict[str, Totals], greedy: bool) -> dict[str, dict]:
    """Per-method figures in the JSON schema of ``specdec bench``."""
    def speed(name: str) -> float | None:
        return totals[name].tokens_per_s if name in totals and totals[name].tokens_per_s > 0 else None

    vanilla, hf = speed("vanilla"), speed("hf-generate")
    reference = totals["vanilla"].outputs() if "vanilla" in totals else {}
    out = {}
    for name, tot in totals.items():
        tps = tot.tokens_per_s
        tau, rates = tot.cycle_stats()
        out[name] = {
            "tokens_per_s": round(tps, 3),
            "speedup_vs_vanilla": round(tps / vanilla, 4) if vanilla else None,
            "speedup_vs_hf_generate": round(tps / hf, 4) if hf else None,
            "tau": _round(tau, 4),
            "accepted_per_position": [round(r, 4) for r in rates],
            "matches_vanilla": matches(tot.outputs(), reference) if greedy and reference else None,
            "time_split": tot.time_split(),
        }
        if GRPC_SUFFIX in name and tau is not None:
            out[name]["wire_bytes_per_cycle"] = _round(tot.per_cycle("wire_bytes"), 1)
        if GRPC_SUFFIX + AHEAD_SUFFIX in name and tau is not None:
            out[name]["ahead_hit_rate"] = _round(tot.ahead_hit_rate(), 4)
            out[name]["ahead_draft_ms_per_cycle"] = _round(1e3 * tot.per_cycle("ahead_draft_s"), 3)
            hit_tau, fresh_tau = tot.ahead_tau()
            out[name]["ahead_tau_hit"], out[name]["ahead_tau_fresh"] = _round(hit_tau, 4), _round(fresh_tau, 4)
    return out


def measure(methods: dict[str, Method], prompts: Sequence[Prompt], repeats: int = 1, seed: int = 0,
            on_warm: Callable[[], None] | None = None,
            progress: Callable[[str], None] | None = None) -> dict[str, Totals]:
    """Warm every method up once on the first prompt, then run the schedule."""
    names = list(methods)
    for name in names:
        methods[name].run(prompts[0], seed)
    if on_warm is not None:
        on_warm()
    totals = {name: Totals() for name in names}
    slots = schedule(names, len(prompts), repeats)
    for i, slot in enumerate(slots):
        if progress is not None and i % len(names) == 0:
            progress(f"repeat {slot.repeat + 1}/{repeats}, prompt {slot.prompt + 1}/{len(prompts)}")
        # the same seed for every method on a (repeat, prompt): sampled runs see the same stream
        totals[slot.method].add(slot, methods[slot.method].run(prompts[slot.prompt],
                                                               seed + 1000 * slot.repeat + slot.prompt))
    return totals


def device_name(device: str = "cpu") -> str:
    """The GPU's name for a CUDA device; else the CPU model and the number of
    threads torch uses, e.g. 'AMD EPYC 7B13, 2 threads (of 2 cores)'."""
    import torch

    if torch.device(device).type == "cuda":
        return f"{torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}"

    model = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    model = model or platform.processor() or platform.machine() or "unknown CPU"
    n = torch.get_num_threads()
    return f"{model}, {n} thread{'s' if n != 1 else ''} (of {os.cpu_count()} cores)"


def stderr_progress(prefix: str) -> Callable[[str], None]:
    def report(msg: str) -> None:
        print(f"[{prefix}] {msg}", file=sys.stderr, flush=True)
    return report


# -- models and methods ------------------------------------------------------------
@dataclass(frozen=True)
class BenchConfig:
    target: str
    eagle: str | None = None
    draft_lm: str | None = None
    eagle3: str | None = None       # EAGLE-3 head directory (method eagle3)
    medusa: str | None = None       # Medusa heads directory (methods medusa, medusa-static)
    hydra: str | None = None        # Hydra heads directory (methods hydra, hydra-static)
    lookahead_wng: LookaheadParams = LookaheadParams()   # W, N, G of method lookahead (the verifiers')
    methods: tuple[str, ...] = DEFAULT_METHODS
    max_new_tokens: int = 128
    temperature: float = 0.0
    tree: TreeParams = TreeParams()
    repeats: int = 1
    seed: int = 0
    grpc: bool = False
    dtype: str = "float32"
    weights: str = "dtype"          # the target's and draft LM's linear layers: dtype, int8 or int4 (--weights)
    device: str = "cpu"             # torch device of every model, e.g. cuda:0
    compile: str = "off"            # compiled target forwards (specdec.compile.forwards): auto, on or off
    tree_sizing: str = "fixed"      # the verifiers' (specdec.tree.sizing): cost or fixed
    compare_tree_sizing: bool = False  # each in-process speculative method also with the other: METHOD@fixed|@cost
    verify_token_budget: int = 0    # the bench orchestrators' --verify-token-budget (0 = off)
    min_tau: float | None = 0.0     # SpeculationGate of every speculative method (0 = always draft;
                                    # None: by drafter kind, knobs.default_min_tau)
    lookahead: tuple[int, ...] = ()  # extra orchestrators drafting one round ahead: METHOD@grpc-aheadN
    compare_unary: bool = False      # an extra orchestrator with unary steps: METHOD@grpc-unary
    compare_plane: bool = False      # a twin of each orchestrator on the relay plane: METHOD@grpc...-relay
    pin: bool = False                # verifier and drafter on a core each, in-process methods on the verifier's
    startup_timeout_s: float = STARTUP_TIMEOUT_S  # --grpc: how long the services may take to be ready
    openai_url: str | None = None    # also run the prompts on this OpenAI-compatible server (bench.openai_peer)
    openai_model: str | None = None  # its model id (None: the first it lists)
    openai_key: str | None = None    # its bearer token
    prefix_cache_tokens: int = 0     # the in-process engines' prefix caches (0: off; methods share prompts)
    prefix_cache_exact: bool = False  # ... prefilling in block-aligned chunks (specdec.model.prefix_cache)

    def gate(self, drafter_kind: str) -> float:
        """The min_tau a method with this drafter kind runs with."""
        from specdec.request.knobs import default_min_tau

        return self.min_tau if self.min_tau is not None else default_min_tau(drafter_kind)

    def __post_init__(self):
        unknown = [m for m in self.methods if m not in ALL_METHODS]
        if unknown:
            raise ValueError(f"unknown method {unknown[0]!r}; choose from {', '.join(ALL_METHODS)}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        SamplingParams(temperature=self.temperature).validate()

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature)


def other_sizing(mode: str) -> str:
    """The tree sizing ``--compare-tree-sizing`` runs beside ``mode`` (its methods: METHOD@<it>)."""
    return "fixed" if mode == "cost" else "cost"


def method_tree(name: str, tree: TreeParams) -> TreeParams:
    """The tree knobs a speculative method runs with: ``tree`` with its method
    (and proposals, for the -top variants)."""
    proposals = "top" if name in TOP_PROPOSALS else tree.proposals
    return replace(tree, method=SPECULATIVE[name][1], proposals=proposals)


def with_references(methods: Sequence[str]) -> tuple[str, ...]:
    """The methods in canonical order, vanilla and hf-generate always among them
    (every speedup and the output check are relative to them)."""
    chosen = set(methods) | set(REFERENCES)
    return tuple(m for m in ALL_METHODS if m in chosen)
