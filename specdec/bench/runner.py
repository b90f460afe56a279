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

from specdec.decoding import StopCriteria
from specdec.params import SamplingParams
from specdec.params import TreeParams

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
}
TOP_PROPOSALS = ("eagle2-top",)            # methods that always propose the draft's top tokens
PEER_METHODS = ("hf-generate", "hf-assisted", "hf-prompt-lookup")
DEFAULT_METHODS = ("vanilla", "hf-generate", "hf-assisted", "hf-prompt-lookup",
                   "chain", "static", "eagle2", "no-value", "no-rerank", "ngram")
ALL_METHODS = DEFAULT_METHODS + ("sps", "eagle2-top")
GRPC_SUFFIX = "@grpc"
AHEAD_SUFFIX = "-ahead"          # METHOD@grpc-aheadN: through an orchestrator with --lookahead N
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
    """``specdec.local.generate``: vanilla with no drafter / tree, else speculative."""

    def __init__(self, verifier, drafter, tree: TreeParams | None, params: SamplingParams, stop: StopCriteria,
                 min_tau: float = 0.0):
        self.verifier, self.drafter, self.tree, self.params, self.stop = verifier, drafter, tree, params, stop
        self.min_tau = min_tau

    def run(self, prompt: Prompt, seed: int | None) -> Sample:
        from specdec.local import generate

        params = self.params if self.params.greedy else replace(self.params, seed=seed)
        t = time.perf_counter()
        dec = generate(self.verifier, self.drafter, prompt.ids, params, self.stop, self.tree, self.min_tau)
        wall = time.perf_counter() - t
        s, ts = dec.stats, dec.stats.time_s
        # with no drafter, the loop's "draft" time is building root-only trees: bookkeeping (other)
        drafted = ts["draft"] + ts["commit"] if self.drafter is not None and self.tree is not None else 0.0
        return Sample(tokens=list(dec.tokens), wall_s=wall, cycles=s.cycles, committed=sum(s.committed_per_cycle),
                      accepted_counts=list(s.accepted_per_position), draft_s=drafted,
                      verify_s=ts["prefill"] + ts["verify"], network_s=0.0)


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
        if GRPC_SUFFIX + AHEAD_SUFFIX in name and tau is not None:
            out[name]["ahead_hit_rate"] = _round(tot.ahead_hit_rate(), 4)
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
    methods: tuple[str, ...] = DEFAULT_METHODS
    max_new_tokens: int = 128
    temperature: float = 0.0
    tree: TreeParams = TreeParams()
    repeats: int = 1
    seed: int = 0
    grpc: bool = False
    dtype: str = "float32"
    device: str = "cpu"             # torch device of every model, e.g. cuda:0
    verify_token_budget: int = 0    # the bench orchestrators' --verify-token-budget (0 = off)
    min_tau: float | None = 0.0     # SpeculationGate of every speculative method (0 = always draft;
                                    # None: by drafter kind, knobs.default_min_tau)
    lookahead: tuple[int, ...] = ()  # extra orchestrators drafting one round ahead: METHOD@grpc-aheadN
    openai_url: str | None = None    # also run the prompts on this OpenAI-compatible server (bench.openai_peer)
    openai_model: str | None = None  # its model id (None: the first it lists)
    openai_key: str | None = None    # its bearer token

    def gate(self, drafter_kind: str) -> float:
        """The min_tau a method with this drafter kind runs with."""
        from specdec.knobs import default_min_tau

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


class Models:
    """Everything loaded once and shared by all methods: one target model object
    serves vanilla, every speculative method and the HF peers."""

    def __init__(self, cfg: BenchConfig):
        from specdec.models import ModelSpec, load_tokenizer
        from verifier.engine import TargetModel, VerifierEngine

        self.cfg = cfg
        self.spec = ModelSpec(path=cfg.target, dtype=cfg.dtype, device=cfg.device)
        self.tokenizer = load_tokenizer(cfg.target)
        self.target = TargetModel(self.spec)
        self.verifier = VerifierEngine(self.target)
        eos = self.tokenizer.eos_token_id
        self.eos_ids = frozenset() if eos is None else frozenset([int(eos)])
        self._drafters: dict[str, object] = {}
        self._assistant = None

    def encode(self, texts: Sequence[str]) -> list[Prompt]:
        prompts = []
        limit = self.target.max_positions
        for i, text in enumerate(texts):
            ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
            if not ids:
                raise ValueError(f"prompt {i + 1} is empty")
            # + depth: a draft tree reaches that far past the last committed token
            if len(ids) + self.cfg.max_new_tokens + self.cfg.tree.depth > limit:
                raise ValueError(f"prompt {i + 1} ({len(ids)} tokens) + max-new-tokens "
                                 f"({self.cfg.max_new_tokens}) + tree depth exceeds the target's "
                                 f"context of {limit} tokens")
            prompts.append(Prompt(text, ids))
        return prompts

    def assistant(self):
        if self._assistant is None:
            from specdec.models import load_causal_lm

            self._assistant = load_causal_lm(replace(self.spec, path=self._need(self.cfg.draft_lm, "draft LM")))
        return self._assistant

    def drafter(self, kind: str):
        if kind not in self._drafters:
            if kind == "eagle":
                from drafter.eagle import EagleDrafter

                self._drafters[kind] = EagleDrafter(self._need(self.cfg.eagle, "EAGLE head"), self.cfg.target,
                                                    device=self.cfg.device)
            elif kind == "ngram":
                from drafter.ngram import NgramDrafter

                self._drafters[kind] = NgramDrafter(self.target.vocab_size)
            elif kind == "draft-lm":
                from drafter.draft_lm import DraftLmDrafter

                self._drafters[kind] = DraftLmDrafter(model=self.assistant())
            else:
                raise ValueError(f"unknown drafter kind {kind!r}")
        return self._drafters[kind]

    @staticmethod
    def _need(path: str | None, what: str) -> str:
        if path is None:
            raise ValueError(f"no {what} directory given")
        return path

    def stop(self) -> StopCriteria:
        return StopCriteria(max_new_tokens=self.cfg.max_new_tokens, eos_ids=self.eos_ids)

    def local(self, name: str, tree: TreeParams | None = None, verifier=None) -> LocalMethod:
        """An in-process method; ``tree`` overrides the knobs of the config."""
        verifier = verifier if verifier is not None else self.verifier
        if name == "vanilla":
            return LocalMethod(verifier, None, None, self.cfg.params, self.stop())
        kind = SPECULATIVE[name][0]
        return LocalMethod(verifier, self.drafter(kind), method_tree(name, tree or self.cfg.tree),
                           self.cfg.params, self.stop(), self.cfg.gate(kind))

    def peer(self, name: str):
        from specdec.bench.peers import HfPeer

        return HfPeer(name, self.target.model, self.cfg.max_new_tokens, self.cfg.temperature, self.eos_ids,
                      assistant=self.assistant() if name == "hf-assisted" else None)


def run_bench(cfg: BenchConfig, texts: Sequence[str], progress: Callable[[str], None] | None = None) -> dict:
    """Load the models, run every method (and its gRPC twin with ``cfg.grpc``)
    on the prompts, interleaved; return the JSON record of ``specdec bench``."""
    from contextlib import ExitStack

    from specdec.bench.calibration import TreeRecorder, calibration_bins
    from specdec.bench.peers import PROMPT_LOOKUP_TOKENS

    names = with_references(cfg.methods)
    models = Models(cfg)
    prompts = models.encode(texts)
    recorder = TreeRecorder(models.verifier)
    methods: dict[str, Method] = {}
    for name in names:
        if name in PEER_METHODS:
            methods[name] = models.peer(name)
        else:
            methods[name] = models.local(name, verifier=recorder if name == CALIBRATED else None)
    with ExitStack() as stack:
        if cfg.grpc:
            from specdec.bench.services import grpc_methods

            methods.update(stack.enter_context(grpc_methods(cfg, names, progress)))
        if cfg.openai_url:
            from specdec.bench.openai_peer import OpenAIPeer

            methods[OPENAI_METHOD] = peer = OpenAIPeer(
                cfg.openai_url, cfg.max_new_tokens, cfg.temperature, cfg.openai_model, cfg.openai_key,
                encode=lambda text: models.tokenizer(text, add_special_tokens=False)["input_ids"])
            stack.callback(peer.close)
        totals = measure(methods, prompts, cfg.repeats, cfg.seed, on_warm=recorder.clear, progress=progress)
    points = recorder.points()
    return {
        "device": device_name(cfg.device),
        "target": cfg.target,
        "temperature": float(cfg.temperature),
        "prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens,
        "methods": summarize(totals, greedy=cfg.params.greedy),
        "tree": {"total_tokens": cfg.tree.total_tokens, "depth": cfg.tree.depth, "expand_k": cfg.tree.expand_k,
                 "min_tau": cfg.min_tau, "lookahead": list(cfg.lookahead) if cfg.grpc else []},
        "models": {"target": cfg.target, "eagle": cfg.eagle, "draft_lm": cfg.draft_lm},
        "repeats": cfg.repeats,
        "openai_url": cfg.openai_url,
        "generated_tokens": {name: tot.tokens for name, tot in totals.items()},
        "peers": {"hf-assisted": "assistant_model = draft LM, HF default assistant-token schedule",
                  "hf-prompt-lookup": f"prompt_lookup_num_tokens = {PROMPT_LOOKUP_TOKENS}"},
        "notes": ["tau counts the bonus token (tokens committed per draft/verify cycle; vanilla = 1)",
                  "accepted_per_position[j]: fraction of cycles accepting >= j+1 draft tokens",
                  "methods interleaved per prompt, order rotated per prompt; one warm-up per method excluded",
                  "stop at EOS or max_new_tokens; tokens/s = generated tokens / generate wall time incl. prefill"],
        "calibration": ({"method": CALIBRATED, "evaluated_nodes": len(points), "bins": calibration_bins(points)}
                        if CALIBRATED in names else None),
    }
