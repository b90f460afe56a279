"""Ahead-of-time compiled target steps (AOTInductor), kept on disk between starts.

A ``torch.compile`` graph is rebuilt by Dynamo in every new process: even with
a warm inductor cache, start-up re-traces the whole model once per width. Here
each fixed-shape step (``specdec.compile.forwards.FixedStep`` at one width and one
capacity) is exported once (``torch.export``), compiled by AOTInductor into a
``.pt2`` package, and on the next start only loaded: no tracing, no code
generation, no Dynamo guards on the call, and a C++ wrapper around the kernels.

- weights, two ways. *Shared*: packages hold no constants
  (``package_constants_in_so`` off); every loaded step points at the model's
  own parameters (``load_constants`` with ``user_managed``), so all widths
  share one copy of the weights, and the linear layers are BLAS calls.
  *Packed*: the weights are frozen into the package and the linear layers
  become inductor's CPP GEMM template over weights pre-packed for it
  (``max_autotune``, kept per shape only where it beats BLAS): on a small
  model's GEMV-shaped steps this halves the step, at the price of one packed
  copy of the weights per width (``specdec.compile.forwards`` picks it for small
  models only);
- K/V writes: the step writes the new slots into its stacked cache input in
  place, as the ``torch.compile`` graph does (the export records the mutation
  and the package replays it on the caller's buffer);
- the key: a shared package holds no weights, so it is reused for any model
  of the same architecture (``layout_fingerprint``: its config but for its
  name, and its parameters' and buffers' names, shapes, dtypes and strides);
  a packed one only for the same model files (``model_fingerprint``: their
  bytes; for a large model their names, sizes and modification times; the
  weights' bytes for a model that is not a directory); both also key on the
  step code (its module's source, the transformers version), torch version,
  dtype, device, CPU (machine and feature flags), width and capacity.
  Packages live in ``specdec-aot/`` under the inductor cache directory
  (``TORCHINDUCTOR_CACHE_DIR``);
- building: one process builds a package while any other start that needs
  it waits on the package's lock file and then loads it (replicas sharing a
  cache, or test workers, build each package once);
- loading: a package's compiled library is unzipped once in its place
  (``kept_library``) and loaded directly, the output structure read once
  (``LoadedStep``): opening one of the demo target's took ~50 ms through the
  package loader, which unzips the package into a fresh directory each time,
  and ~25 ms this way;
- pruning: each start marks the directories it uses (``mark_used``) and
  removes, once per process, those no start has used for ``UNUSED_DAYS``
  (``prune_unused``): the packages of code, torch versions or models gone
  since. A directory still in use by another deployment sharing the cache is
  marked by its every start, so only a fleet that has not started for that
  long loses its packages (and rebuilds them).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import inspect
import json
import logging
import os
import platform
import shutil
import tempfile
import threading
import time
import weakref
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.utils._pytree as pytree
import transformers
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch._inductor.utils import parallel_num_threads

from specdec.model.quantize import shared_weight_lowerings, weights_key

# shared: the package holds no weights; the caller's parameters are bound at load
SHARED_CONFIG = {"aot_inductor.package_constants_in_so": False}
# packed: weights frozen into the package, the linear layers as inductor's CPP
# GEMM template over weights packed for it, where it beats the BLAS call
PACKED_CONFIG = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                 "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}   # quiet start-up
HASHED_BYTES = 256 << 20       # a model directory up to this size is keyed by its bytes
UNUSED_DAYS = 14               # a package directory no start has used for this long is removed
USED_MARK = "last-used"        # the file whose modification time says when a start last used a directory

log = logging.getLogger(__name__)
_pruned: set[Path] = set()     # package roots this process has pruned (once each)
_pruning = threading.Lock()
_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()     # model -> ``model_fingerprint``
# the files a model directory's identity is read from
BUILT: list[int] = [0]         # packages this process built (``build_package``); the bench reads it around its timing
MODEL_FILES = ("*.json", "*.safetensors", "*.bin", "*.pt", "*.model", "*.txt")


def model_fingerprint(model: torch.nn.Module) -> str:
    """A digest that changes with the model: its directory's files where it was
    loaded from one (their bytes up to ``HASHED_BYTES`` in all, else their
    names, sizes and modification times), else its weights' bytes; read once
    per loaded model (a verifier started for EAGLE-3 heads keys two sets of
    packages by it: hashing the demo target's files takes ~20 ms)."""
    known = _fingerprints.get(model)
    if known is None:
        known = _fingerprints[model] = _fingerprint(model)
    return known


def _fingerprint(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, param in model.named_parameters():      # the weights' layout (specdec.model.loading.input_major_linears)
        digest.update(f"{name}:{tuple(param.stride())};".encode())
    digest.update(weights_key(model).encode())        # quantized linears (specdec.model.quantize), '' for none
    source = Path(str(getattr(getattr(model, "config", None), "_name_or_path", "") or ""))
    files = sorted({f for pattern in MODEL_FILES for f in source.glob(pattern)}) if source.is_dir() else []
    if files and sum(f.stat().st_size for f in files) <= HASHED_BYTES:
        for f in files:
            digest.update(f.name.encode())
            digest.update(f.read_bytes())
    elif files:
        digest.update(str(source.resolve()).encode())
        for f in files:
            st = f.stat()
            digest.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    else:
        config = getattr(model, "config", None)
        if config is not None:
            digest.update(json.dumps(config.to_dict(), sort_keys=True, default=str).encode())
        for name, t in model.state_dict().items():
            digest.update(name.encode())
            digest.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:20]


def layout_fingerprint(model: torch.nn.Module) -> str:
    """A digest of what a shared package is traced from besides the weights'
    values: the model's config (but for where it was loaded from) and its
    parameters' and buffers' names, shapes, dtypes and strides; two models
    that differ only in their weights' values share it (a shared package
    takes every parameter and buffer as an input: ``shared_weights``)."""
    digest = hashlib.sha256()
    seen: set[int] = set()
    for module in model.modules():             # the model's config, and a head's inside a key module
        config = getattr(module, "config", None)
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        settings = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
        settings = {k: v for k, v in settings.items() if k not in ("_name_or_path", "transformers_version")}
        digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    for name, t in named.items():
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{tuple(t.stride())};".encode())
    digest.update(weights_key(model).encode())        # quantized linears (specdec.model.quantize), '' for none
    return digest.hexdigest()[:20]


def code_fingerprint(step: torch.nn.Module, sources: tuple[str, ...] = ()) -> str:
    """A digest of the code a package was traced from: the step's own module
    source, the transformers version (the model's forward) and ``sources``
    (more source files the step runs)."""
    digest = hashlib.sha256(transformers.__version__.encode())
    digest.update(Path(inspect.getfile(type(step))).read_bytes())
    for source in sorted(set(sources)):
        digest.update(Path(source).read_bytes())
    return digest.hexdigest()[:8]


def package_dir(step: torch.nn.Module, model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                sources: tuple[str, ...] = (), variant: str = "", packed: bool = False) -> Path:
    """Where the packages of ``step`` over ``model`` at ``dtype`` on ``device``
    live, ``packed`` (keyed by the model's files) or shared (by its layout);
    ``variant`` tells apart steps of one class that return different things.
    On CPU also by the thread count torch has now: inductor writes a kernel's
    parallel loops for the count it compiles at, and none at one thread, so a
    package built at one count and run at another runs at the first (a
    two-thread bench over one-thread packages ran serially, slower than
    llama.cpp; over two-thread ones 1.36–1.56× it). The directory is chosen
    when the graphs are set up, so a verifier that changes its count between
    requests (``--solo-threads``) keeps its start-up count's packages."""
    machine = hashlib.sha256(cpu_identity().encode()).hexdigest()[:8]
    model_key = model_fingerprint(model) if packed else "layout-" + layout_fingerprint(model)
    threads = parallel_num_threads() if device.type == "cpu" else 1
    key = (f"{model_key}-{code_fingerprint(step, sources)}-torch{torch.__version__}-"
           f"{str(dtype).removeprefix('torch.')}-{device.type}-{machine}" + (f"-{variant}" if variant else "")
           + (f"-t{threads}" if threads > 1 else ""))
    return Path(cache_dir()) / "specdec-aot" / key


def package_path(root: Path, width: int, capacity: int, packed: bool, batched: bool = False) -> Path:
    return root / f"step-w{width}-c{capacity}{'-batch' if batched else ''}-{'packed' if packed else 'shared'}.pt2"


def build_package(step: torch.nn.Module, example: tuple, path: Path, packed: bool, dynamic_shapes=None) -> None:
    """Export ``step`` at the shapes of ``example`` (``dynamic_shapes``: the
    dimensions left free, as ``torch.export`` takes them) and compile it into
    the package ``path`` (written whole or not at all: a concurrent start may
    race), ``packed`` or over shared weights (module doc)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        exported = torch.export.export(step, example, dynamic_shapes=dynamic_shapes, strict=False)
    fd, tmp = tempfile.mkstemp(suffix=".pt2", dir=path.parent)
    os.close(fd)
    try:
        with contextlib.nullcontext() if packed else shared_weight_lowerings():
            torch._inductor.aoti_compile_and_package(exported, package_path=tmp,
                                                      inductor_configs=PACKED_CONFIG if packed else SHARED_CONFIG)
        os.replace(tmp, path)
        BUILT[0] += 1
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def mark_used(root: Path) -> None:
    """Record that this start uses the packages in ``root`` (``prune_unused``'s clock);
    the first call in a process for a cache also prunes it."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        (root / USED_MARK).touch()
    except OSError as exc:        # a read-only cache: nothing to record (building there fails on its own)
        log.info("cannot mark %s as used: %s", root, exc)
        return
    with _pruning:
        first = root.parent not in _pruned
        _pruned.add(root.parent)
    if first:
        prune_unused(root.parent)


def prune_unused(parent: Path, days: float = UNUSED_DAYS, now: float | None = None) -> list[Path]:
    """Remove the package directories under ``parent`` that no start has used
    for ``days`` (by their ``USED_MARK``, else their own modification time);
    the ones removed."""
    cutoff = (time.time() if now is None else now) - days * 86400
    removed = []
    for entry in sorted(parent.iterdir()) if parent.is_dir() else ():
        if not entry.is_dir():
            continue
        mark = entry / USED_MARK
        try:
            used = (mark if mark.exists() else entry).stat().st_mtime
        except OSError:
            continue
        if used < cutoff:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
            log.info("removed compiled packages unused for %g days: %s", days, entry.name)
    return removed


def shared_weights(step: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``step`` by name (tied ones under each name)."""
    named = dict(step.named_parameters(remove_duplicate=False))
    named.update(step.named_buffers(remove_duplicate=False))
    return {name: t.detach() for name, t in named.items()}


def cpu_identity() -> str:
    """The machine and its CPU's feature flags: a package's kernels are built for them."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = platform.processor()
    return f"{platform.machine()}:{hashlib.sha256(flags.encode()).hexdigest()[:12]}"


class LoadedStep:
    """A package's compiled step, called with its inputs as exported: the
    container runner over the package's kept library (``load_package``), its
    output structure read once (``AOTICompiledModel`` parses it on every call)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.out_spec = pytree.treespec_loads(runner.get_call_spec()[1])

    def __call__(self, *inputs):
        flat = [x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor)]   # (a mask may be a dict)
        return pytree.tree_unflatten(self.runner.run(flat), self.out_spec)

    def get_constant_fqns(self) -> list[str]:
        return list(self.runner.get_constant_names_to_original_fqns().values())

    def load_constants(self, constants: dict[str, torch.Tensor]) -> None:
        """Point the step at ``constants`` by their original names (not copied:
        the caller keeps them alive), every constant given."""
        names = self.runner.get_constant_names_to_original_fqns()
        self.runner.update_constant_buffer({name: constants[fqn] for name, fqn in names.items()}, False, True, True)


def package_built(path: Path) -> bool:
    """Whether the package ``path`` is on disk: as built, or as the library kept in its place (``kept_library``)."""
    return path.exists() or path.with_suffix(".so").exists()


def kept_library(path: Path) -> Path:
    """The compiled library of the package ``path``, unzipped once into
    ``<package>.so`` (written whole or not at all), which then stands in for
    the package (removed: one copy on disk): loading a package unzips it into
    a fresh directory every time, half of a ~50 ms open of the demo
    target's. A package on disk (just built, or left by an older specdec)
    replaces the library it finds."""
    library = path.with_suffix(".so")
    try:
        archive = zipfile.ZipFile(path)
    except FileNotFoundError:
        if library.exists():
            return library
        raise
    with archive:
        member = next(n for n in archive.namelist() if n.endswith(".so") and "/data/aotinductor/model/" in n)
        calls = member.removesuffix(".so") + ".json"     # the aten calls it makes through the proxy executor
        if calls in archive.namelist():                  # (kernels with no C shim: the int4 product)
            _unzip(archive, calls, library.with_suffix(".json"))
        _unzip(archive, member, library)
    path.unlink(missing_ok=True)      # (a start loading it beside this one falls back on the library)
    return library


def _unzip(archive: zipfile.ZipFile, member: str, target: Path) -> None:
    """``member`` of ``archive`` written to ``target`` whole or not at all."""
    fd, tmp = tempfile.mkstemp(suffix=target.suffix, dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out, archive.open(member) as source:
            shutil.copyfileobj(source, out, 1 << 20)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_package(path: Path, weights: dict[str, torch.Tensor] | None):
    """The compiled step in ``path``, run over ``weights`` (not copied; None:
    a packed package, which holds its own). The package's library is loaded
    directly (``kept_library``): ``aoti_load_package`` would also first probe
    the CPU's vector ISA by building and loading test programs (~1 s a
    start), which the package key (``cpu_identity``) already stands for."""
    step = LoadedStep(torch._C._aoti.AOTIModelContainerRunnerCpu(str(kept_library(path)), 1))
    if weights is None:
        return step
    missing = [n for n in step.get_constant_fqns() if n not in weights]
    if missing:
        raise RuntimeError(f"the package {path.name} needs constants the model lacks: {', '.join(missing[:3])}")
    step.load_constants(weights)
    return step


def ensure_package(step: torch.nn.Module, example: Callable[[], tuple], root: Path, width: int, capacity: int,
                   packed: bool, batch_dims: Callable[[tuple], tuple] | None = None) -> Path:
    """The package for (width, capacity) in ``root``, built there first if
    absent (at the shapes of ``example()``); with ``batch_dims``, one whose
    batch dimension is free (``batch_dims(example)``: the dynamic shapes)."""
    path = package_path(root, width, capacity, packed, batch_dims is not None)
    if package_built(path):
        return path
    root.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # released on close, or by the kernel if this process dies
        if not package_built(path):               # (another start may have built it while this one waited)
            inputs = example()
            build_package(step, inputs, path, packed, None if batch_dims is None else batch_dims(inputs))
    return path


def load_or_build(step: torch.nn.Module, example: Callable[[], tuple], root: Path, width: int, capacity: int,
                  weights: dict[str, torch.Tensor] | None, batch_dims: Callable[[tuple], tuple] | None = None):
    """The compiled step for (width, capacity): loaded from ``root``, built
    there first if absent; packed when ``weights`` is None; batched as in
    ``ensure_package``."""
    return load_package(ensure_package(step, example, root, width, capacity, weights is None, batch_dims), weights)
