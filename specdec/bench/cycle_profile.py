"""``specdec bench profile --cycle``: what one speculative cycle asks of the host.

    specdec bench profile --cycle --methods vanilla,eagle2,eagle3 --compile on --json cycle.json
    specdec bench profile --cycle --device cuda --compile on --methods vanilla,eagle2 --json cycle.json

Runs the bundled prompts through each method in-process (``specdec.local``'s
loop over the engines) and counts, per cycle and per code site (the innermost
function of this project that asked):

- **host syncs**, what stalls the host on a device, counted on any device:
  - ``reads``: a tensor's value read by the host (``item``, ``tolist``,
    ``numpy``, ``cpu``, ``bool``/``int``/``float``/``index`` of a tensor,
    ``torch.equal``/``allclose``);
  - ``uploads``: host data placed on the model's device: a tensor made
    from Python data with a ``device`` (``torch.tensor``, ``as_tensor``), or
    a host tensor moved with ``to(device)`` / ``cuda()``: on a device, a
    blocking copy up (a host tensor made without a device stays on the host
    and costs nothing until it is moved);
  - ``shaped``: an operator whose output shape depends on values (``nonzero``,
    ``masked_select``, boolean indexing, ``unique``...), which reads back to
    size its output.
  On a CPU nothing waits, but the same code runs with its tensors on a GPU,
  so every one of these counts here too: host bookkeeping belongs in Python
  ints and lists;
- **eager operators**: aten operators dispatched outside compiled graphs
  that launch work (views and allocations are not counted): on a GPU, each is
  a kernel launch;
- **graph replays**: calls of compiled steps (``specdec.compile.fixed_graphs``),
  inside which nothing above is counted.

The counts come from a ``TorchFunctionMode`` (reads, uploads) and a
``TorchDispatchMode`` (operators) held over the cycles, and are deterministic
for greedy runs. Prefill and release are counted apart (``prefill``) and left
out of the per-cycle figures. On CUDA the run also reports, from a second
pass of the same prompts, what the device saw: synchronising calls
(``torch.cuda.set_sync_debug_mode``), and from a third under
``torch.profiler``, ``cudaLaunchKernel``, ``cudaGraphLaunch``,
``cudaMemcpyAsync`` and the stream/device/event synchronisations per cycle.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
import warnings
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from specdec.bench.runner import SPECULATIVE
from specdec.compile import fixed_graphs
from specdec.local import LocalDrafter, LocalVerifier
from specdec.request.decoding import Decoding
from specdec.request.params import SamplingParams
from specdec.request.speculative import Request, speculative_generate

ROOT = Path(__file__).resolve().parents[2]               # the checkout: sites are named relative to it
OWN_FILES = (str(Path(__file__).resolve()), str(Path(fixed_graphs.__file__).resolve()))
PROJECT = tuple(str(ROOT / d) + "/" for d in ("specdec", "drafter", "verifier", "orchestrator"))

T = torch.Tensor
READS = {T.item, T.tolist, T.numpy, T.cpu, T.__bool__, T.__int__, T.__float__, T.__index__, T.__array__,
         T.equal, T.allclose, torch.equal, torch.allclose, torch.is_nonzero}
UPLOADS = {torch.tensor, torch.as_tensor, torch.asarray}
MOVES = {T.to, T.cuda}
# operators whose output shape is read from the values
SHAPED = {"aten::nonzero", "aten::masked_select", "aten::_unique", "aten::_unique2", "aten::unique_dim",
          "aten::unique_consecutive", "aten::nonzero_static"}
# dispatched but launching nothing (allocation, aliasing, the scalar read counted as a read)
QUIET = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::lift_fresh", "aten::_local_scalar_dense",
         "aten::detach", "aten::alias", "aten::resize_", "aten::set_", "aten::_to_copy_noop"}
# the calls of a verifier / drafter session that are each its phase; the rest of a cycle is the loop's
PHASES = {"prefill": "prefill", "verify": "verify", "draft": "draft", "draft_ahead": "draft", "release": "prefill"}
CUDA_CALLS = {"cudaLaunchKernel": "kernel_launches", "cudaLaunchKernelExC": "kernel_launches",
              "cuLaunchKernel": "kernel_launches", "cuLaunchKernelEx": "kernel_launches",
              "cudaGraphLaunch": "graph_launches", "cudaMemcpyAsync": "memcpys", "cudaMemcpy": "memcpys",
              "cudaStreamSynchronize": "synchronizes", "cudaDeviceSynchronize": "synchronizes",
              "cudaEventSynchronize": "synchronizes"}


def site() -> str:
    """The innermost frame of this project's code below the counting one, as path:function."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(PROJECT) and name not in OWN_FILES:
            return f"{Path(name).relative_to(ROOT)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "(outside the project)"


@dataclass
class Counts:
    """What was counted in one phase, by kind and by (kind, site)."""

    kinds: Counter = field(default_factory=Counter)     # reads | uploads | shaped | ops | replays
    sites: Counter = field(default_factory=Counter)     # (kind, site) -> n

    def add(self, kind: str, where: str) -> None:
        self.kinds[kind] += 1
        self.sites[(kind, where)] += 1

    @property
    def syncs(self) -> int:
        return self.kinds["reads"] + self.kinds["uploads"] + self.kinds["shaped"]


class Tally:
    """The two modes and the replay watch, counting into the current phase."""

    def __init__(self) -> None:
        self.phase = "loop"
        self.phases: dict[str, Counts] = {}

    def add(self, kind: str, where: str | None = None) -> None:
        self.phases.setdefault(self.phase, Counts()).add(kind, where or site())

    @contextmanager
    def replay(self, name: str):
        self.add("replays", name)
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            yield

    @contextmanager
    def in_phase(self, phase: str):
        before, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = before


class ReadMode(TorchFunctionMode):
    def __init__(self, counter: Tally):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS:
            self.counter.add("reads")
        elif func in UPLOADS and kwargs.get("device") is not None and not (args and isinstance(args[0], torch.Tensor)):
            self.counter.add("uploads")
        elif func in MOVES and args[0].device.type == "cpu" and _placed(func, args[1:], kwargs):
            self.counter.add("uploads")
        return func(*args, **kwargs)


def _placed(func, args: tuple, kwargs: dict) -> bool:
    """Whether a ``to`` / ``cuda`` call names a device to place a host tensor on."""
    if func is T.cuda:
        return True
    return kwargs.get("device") is not None or any(
        isinstance(a, (torch.device, str)) or (isinstance(a, int) and not isinstance(a, bool)) for a in args)


class OpMode(TorchDispatchMode):
    def __init__(self, counter: Tally):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in SHAPED or (name == "aten::index" and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))):
            self.counter.add("shaped")
        elif not func.is_view and name not in QUIET:
            self.counter.add("ops")
        return func(*args, **kwargs)


class Phased:
    """A verifier or drafter session whose calls count in their phase (``PHASES``)."""

    def __init__(self, inner, counter: Tally):
        self._inner, self._counter = inner, counter

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if name not in PHASES:
            return attr

        async def call(*args, **kwargs):
            with self._counter.in_phase(PHASES[name]):
                return await attr(*args, **kwargs)
        return call


@contextmanager
def counting(counter: Tally):
    fixed_graphs.REPLAY_WATCH[0] = counter.replay
    try:
        with ReadMode(counter), OpMode(counter):
            yield
    finally:
        fixed_graphs.REPLAY_WATCH[0] = None


@contextmanager
def cuda_sync_warnings(counter: Tally):
    """``torch.cuda.set_sync_debug_mode('warn')``: each synchronising CUDA call
    warns; the warnings count as ``device_syncs`` in the current phase."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            counter.add("device_syncs")
        else:
            shown(message, category, filename, lineno, file, line)

    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(before)


def generate_counted(method, prompt: list[int], counter: Tally | None, seed: int | None) -> Decoding:
    """One prompt through ``method`` (``specdec.bench.runner.LocalMethod``), its
    sessions' calls counted in their phases when ``counter`` is given."""
    sid = uuid.uuid4().hex
    params = method.params if method.params.greedy else replace(method.params, seed=seed)
    request = Request(prompt, params, method.tree if method.drafter is not None else None)
    layers = tuple(getattr(method.drafter, "feature_layers", ()))
    verifier = LocalVerifier(method.verifier, sid, None, layers)
    drafter = LocalDrafter(method.drafter, sid) if method.drafter is not None else None
    if counter is not None:
        verifier = Phased(verifier, counter)
        drafter = Phased(drafter, counter) if drafter is not None else None
    return asyncio.run(speculative_generate(verifier, drafter, request, Decoding(method.stop, method.min_tau)))


@dataclass
class CycleCounts:
    """One method's counts over its prompts."""

    method: str
    cycles: int
    tokens: int
    phases: dict[str, Counts]
    cuda: dict[str, float] | None = None      # per cycle: device_syncs, kernel_launches, graph_launches, ...

    def per_cycle(self, kind: str, phases: tuple[str, ...] = ("loop", "draft", "verify")) -> float:
        return sum(self.phases[p].kinds[kind] for p in phases if p in self.phases) / max(1, self.cycles)

    def syncs_per_cycle(self) -> float:
        return sum(self.per_cycle(k) for k in ("reads", "uploads", "shaped"))

    def sites(self, kinds: tuple[str, ...], n: int | None = None) -> list[dict]:
        """The cycles' sites of ``kinds``, most first (prefill's left out)."""
        sites: Counter = Counter()
        for phase, counts in self.phases.items():
            if phase != "prefill":
                for (kind, where), k in counts.sites.items():
                    if kind in kinds:
                        sites[(kind, where)] += k
        return [{"kind": kind, "site": where, "per_cycle": round(k / max(1, self.cycles), 2)}
                for (kind, where), k in sites.most_common(n)]

    def record(self) -> dict:
        kinds = ("reads", "uploads", "shaped", "ops", "replays")
        return {"cycles": self.cycles, "tokens": self.tokens,
                "tau": round(self.tokens / self.cycles, 3) if self.cycles else None,
                "per_cycle": {"syncs": round(self.syncs_per_cycle(), 2),
                              **{k: round(self.per_cycle(k), 2) for k in kinds}},
                "by_phase": {p: {"syncs_per_cycle": round(c.syncs / max(1, self.cycles), 2),
                                 **{k: round(c.kinds[k] / max(1, self.cycles), 2) for k in kinds}}
                             for p, c in sorted(self.phases.items())},
                "sync_sites": self.sites(("reads", "uploads", "shaped")),
                "op_sites": self.sites(("ops",), 12),
                "cuda": self.cuda}


def count_method(name: str, method, prompts: list[list[int]], seed: int = 0) -> CycleCounts:
    """Count ``method`` over ``prompts`` (after one uncounted warm-up prompt)."""
    generate_counted(method, prompts[0], None, seed)            # graphs opened, CUDA graphs recorded
    counter = Tally()
    cycles = tokens = 0
    cuda = str(getattr(method.verifier.target, "device", "cpu")).startswith("cuda")
    with torch.inference_mode(), counting(counter), (cuda_sync_warnings(counter) if cuda else nullcontext()):
        for i, prompt in enumerate(prompts):
            with counter.in_phase("loop"):
                dec = generate_counted(method, prompt, counter, seed + i)
            cycles += dec.stats.cycles
            tokens += len(dec.tokens) - 1            # the prefill's first token is no cycle's
    result = CycleCounts(name, cycles, tokens, counter.phases)
    if cuda:
        result.cuda = {"device_syncs": round(result.per_cycle("device_syncs"), 2),
                       **cuda_calls(method, prompts, seed, cycles)}
    return result


def cuda_calls(method, prompts: list[list[int]], seed: int, cycles: int) -> dict[str, float]:
    """The CUDA runtime calls of the same prompts per cycle, from ``torch.profiler``
    (prefill included: an upper bound)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i, prompt in enumerate(prompts):
            generate_counted(method, prompt, None, seed + i)
        torch.cuda.synchronize()
    calls: Counter = Counter()
    for event in prof.key_averages():
        if event.key in CUDA_CALLS:
            calls[CUDA_CALLS[event.key]] += event.count
    return {k: round(v / max(1, cycles), 2) for k, v in sorted(calls.items())}


def run_cycle_profile(cfg, texts: list[str], sampling: SamplingParams, progress=None) -> dict:
    """Count every method of ``cfg`` (``specdec.bench.runner.BenchConfig``) over
    ``texts``, sampling with ``sampling`` (seeded from ``cfg.seed`` when T > 0)."""
    from specdec.bench.runner import device_name
    from specdec.bench.suite import Models

    models = Models(cfg)
    prompts = [p.ids for p in models.encode(texts)]
    result = {"device": device_name(cfg.device), "target": cfg.target, "compile": cfg.compile,
              "prompts": len(prompts), "max_new_tokens": cfg.max_new_tokens,
              "sampling": {k: v for k, v in vars(sampling).items() if k != "seed"}, "methods": {}}
    for name in cfg.methods:
        if name != "vanilla" and name not in SPECULATIVE:
            raise ValueError(f"--cycle counts in-process methods (vanilla, {', '.join(SPECULATIVE)}), not {name!r}")
        if progress:
            progress(f"counting {name}")
        method = models.local(name)
        method.params = sampling
        result["methods"][name] = count_method(name, method, prompts, cfg.seed).record()
    return result


def cycle_markdown(result: dict) -> str:
    cuda = any(r["cuda"] for r in result["methods"].values())
    head = ["method", "cycles", "τ", "host syncs", "reads", "uploads", "shaped", "eager ops", "replays"]
    if cuda:
        head += ["CUDA syncs", "kernel launches", "graph launches", "memcpys", "stream syncs"]
    lines = [f"Per cycle, {result['prompts']} prompts × {result['max_new_tokens']} tokens, "
             f"{result['device']}, compile {result['compile']}:", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in result["methods"].items():
        pc = r["per_cycle"]
        row = [name, str(r["cycles"]), f"{r['tau']:.2f}" if r["tau"] else "-", f"{pc['syncs']:.2f}",
               f"{pc['reads']:.2f}", f"{pc['uploads']:.2f}", f"{pc['shaped']:.2f}", f"{pc['ops']:.1f}",
               f"{pc['replays']:.2f}"]
        if cuda:
            c = r["cuda"] or {}
            row += [f"{c.get(k, 0):.2f}" for k in ("device_syncs", "kernel_launches", "graph_launches", "memcpys",
                                                   "synchronizes")]
        lines.append("| " + " | ".join(row) + " |")
    for name, r in result["methods"].items():
        lines += ["", f"{name}, per cycle: host syncs by site, then the most eager operators", ""]
        lines += [f"- {s['per_cycle']:.2f} {s['kind']} {s['site']}" for s in r["sync_sites"] + r["op_sites"]]
    return "\n".join(lines)
