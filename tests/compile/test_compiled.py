"""Compiled target forwards (``specdec.compile.forwards``): greedy output token-identical
to eager vanilla on the demo target and on a tiny non-Llama family, seeded
sampling reproducible, the padding helpers, the per-model fallback to eager
forwards with one log line, the stacked K/V buffer the steps write in place,
and the ahead-of-time packages (reloaded, over the model's own weights, keyed
by the model files when packed and by the model's layout when shared, built
once by concurrent starts, their libraries unzipped once in their place)."""

from __future__ import annotations

import functools
import logging
import os
import zipfile

import pytest
import torch
from families import BY_NAME

from specdec.compile.eager import eager_forward, eager_run
from specdec.compile import aot, fixed_kv, forwards, startup
from specdec.local import generate
from specdec.model import kv
from specdec.model.loading import PACKED_ENV, ModelSpec, demo_path, load_tokenizer
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from verifier.engine import TargetModel, VerifierEngine

PROMPTS = ["def fibonacci(n):\n    ", "class Stack:\n    def __init__(self):\n        self."]
SMALL_TREE = TreeParams(total_tokens=8, depth=3, expand_k=4)     # verify widths 1..8: few graphs


def test_buckets():
    assert [forwards.capacity_bucket(n) for n in (0, 1, 256, 257, 512, 513, 2000)] == [256, 256, 256, 512, 512, 1024, 2048]
    assert [forwards.width_bucket(n) for n in (1, 3, 16, 17, 64, 65)] == [1, 4, 16, 32, 64, None]


def test_pad_mask_hides_unused_slots_and_pads_see_themselves():
    low = torch.finfo(torch.float32).min
    mask = torch.zeros(1, 1, 3, 7)                      # 3 queries after 4 cached slots
    mask[0, 0, 0, 5:] = low
    out = fixed_kv.pad_mask(mask, 4, 16)
    assert out.shape == (1, 1, 4, 16)
    assert torch.equal(out[:, :, :3, :7], mask)
    assert (out[:, :, :3, 7:] == low).all()
    assert out[0, 0, 3, 7] == 0 and (out[0, 0, 3, :7] == low).all() and (out[0, 0, 3, 8:] == low).all()


GREEDY = SamplingParams()


def _tokens(verifier, drafter, prompts, tree=None, params=GREEDY, n=24):
    stop = StopCriteria(max_new_tokens=n, eos_ids=frozenset())
    return [generate(verifier, drafter, p, params, stop, tree).tokens for p in prompts]


@pytest.fixture(scope="module")
def demo_engines():
    from drafter.eagle.eagle2 import EagleDrafter

    eager = TargetModel(ModelSpec(str(demo_path("target"))))
    fast = TargetModel(ModelSpec(str(demo_path("target"))), model=eager.model)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(PACKED_ENV, "auto")                  # as users run it: packed weights for a small model
        fast.compiled = startup.compile_target(fast.lm, "on")
    assert fast.compiled is not None
    tok = load_tokenizer(demo_path("target"))
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    drafter = EagleDrafter(demo_path("eagle"), demo_path("target"))
    return VerifierEngine(eager), VerifierEngine(fast), drafter, prompts


@pytest.mark.slow             # builds the demo target's packages: ~4.5 min on a cold cache
def test_demo_target_greedy_identical_to_eager_vanilla(demo_engines):
    eager, fast, drafter, prompts = demo_engines
    want = _tokens(eager, None, prompts)
    assert _tokens(fast, None, prompts) == want
    assert _tokens(fast, drafter, prompts, SMALL_TREE) == want          # tree verifies on the compiled path


@pytest.mark.slow             # builds the demo target's packages: ~4.5 min on a cold cache
def test_demo_target_takes_the_compiled_path(demo_engines):
    _, fast, _, prompts = demo_engines
    cache = fast.target.new_cache(40)
    assert kv.seq_len(cache) == 0 and cache.layers[0].capacity == forwards.MIN_CAPACITY
    ids = torch.tensor(prompts[0])
    fast.target.forward(cache, ids, torch.arange(len(ids)), None)
    assert fast.target.compiled.accepts(cache, 1) and fast.target.compiled.accepts(cache, 8)
    assert not fast.target.compiled.accepts(cache, 65)                  # wider than any compiled graph
    assert fast.target.compiled.packed                                  # a small model: packed weights


@pytest.mark.slow             # builds the demo target's packages: ~4.5 min on a cold cache
def test_demo_target_seeded_sampling_reproducible(demo_engines):
    _, fast, _, prompts = demo_engines
    params = SamplingParams(temperature=0.8, seed=7)
    assert _tokens(fast, None, prompts[:1], params=params) == _tokens(fast, None, prompts[:1], params=params)


def test_packed_packages_give_the_eager_logits(tiny_family):
    """The packed path (the weights frozen into each package, inductor's CPP
    GEMM), which the rest of the suite leaves off (``tests/conftest.py``)."""
    lm = TargetModel(ModelSpec(str(tiny_family["target"]))).lm
    forward = forwards.CompiledForward(lm, packed=True)
    assert forward.packed and forward.steps.weights is None
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    with torch.inference_mode():                  # one packed graph (they build slowly): a one-token step
        cache, eager_cache = forward.new_cache(), lm.new_cache(8)
        for c in (cache, eager_cache):
            lm.hidden(c, ids[:, :4], torch.arange(4)[None], None)
        got = forward.run(cache, ids[:, 4:], torch.tensor([[4]]), None)
        want = eager_run(lm, eager_cache, ids[:, 4:], torch.tensor([[4]]), None)
    assert got is not None and torch.allclose(got[2], want[2], atol=1e-4) and torch.allclose(got[0], want[0], atol=1e-4)
    assert aot.package_built(aot.package_path(forward.packages, 1, forwards.MIN_CAPACITY, True))


def test_non_llama_family_greedy_identical(family_dir):
    from drafter.ngram import NgramDrafter

    family = BY_NAME["qwen3"]
    path = family_dir(family)
    eager = VerifierEngine(TargetModel(ModelSpec(str(path))))
    fast = VerifierEngine(TargetModel(ModelSpec(str(path), compile="on")))
    assert fast.target.compiled is not None
    prompts = [[3, 17, 42, 9, 3, 17, 42], [5, 6, 7, 8, 5, 6]]
    want = _tokens(eager, None, prompts, n=16)
    assert _tokens(fast, None, prompts, n=16) == want
    ngram = NgramDrafter(fast.target.vocab_size)
    assert _tokens(fast, ngram, prompts, TreeParams(total_tokens=6, depth=4), n=16) == want


def test_a_session_moves_up_the_capacity_buckets_as_it_fills(tiny_family):
    from drafter.ngram import NgramDrafter

    path = str(tiny_family["target"])
    eager = VerifierEngine(TargetModel(ModelSpec(path)))
    fast = VerifierEngine(TargetModel(ModelSpec(path, compile="on")))
    small = forwards.MIN_CAPACITY
    prompt = [(7 * i) % 60 + 1 for i in range(small - 30)]
    want = _tokens(eager, None, [prompt], n=60)
    assert _tokens(fast, None, [prompt], n=60) == want
    assert _tokens(fast, NgramDrafter(fast.target.vocab_size), [prompt], SMALL_TREE, n=60) == want
    cache = fast.target.new_cache(4096)
    assert cache.fixed_buffers.stack.shape[4] == small           # the smallest bucket, whatever the reservation
    ids = torch.tensor(prompt)
    fast.target.forward(cache, ids, torch.arange(len(ids)), None)
    before = cache.fixed_buffers.stack
    for step in range(40):                                       # one token at a time across the bucket's end
        n = len(prompt) + step
        fast.target.forward(cache, torch.tensor([step % 50]), torch.tensor([n]), None)
    fixed = fixed_kv.fixed_buffers(cache)
    assert fixed is not None and fixed.stack.shape[4] == forwards.capacity_bucket(small + 1)
    assert torch.equal(fixed.stack[:, :, :, :, :len(prompt)], before[:, :, :, :, :len(prompt)])
    assert (fixed.stack[:, :, :, :, kv.seq_len(cache):] == 0).all()


def test_batched_verifies_keep_a_session_on_its_stacked_buffer_across_buckets(tiny_family):
    from specdec.tree.layout import tree_from_lists

    path = str(tiny_family["target"])
    eager = VerifierEngine(TargetModel(ModelSpec(path)))
    fast = VerifierEngine(TargetModel(ModelSpec(path, compile="on")))
    small = forwards.MIN_CAPACITY
    prompts = [[(5 * i + b) % 70 + 1 for i in range(small - 4)] for b in range(2)]
    want = _tokens(eager, None, prompts, n=12)
    roots = [fast.prefill(f"b{b}", p, GREEDY, max_new_tokens=12).token for b, p in enumerate(prompts)]
    got = [[r] for r in roots]
    for _ in range(11):                     # root-only trees, batched: one token a session a verify
        results = fast.verify_batch([(f"b{b}", tree_from_lists([got[b][-1]], [-1])) for b in range(2)])
        for b, result in enumerate(results):
            got[b] += result.tokens
    assert got == want
    for b in range(2):
        fixed = fixed_kv.fixed_buffers(fast.sessions.get(f"b{b}").cache)
        assert fixed is not None and fixed.stack.shape[4] == forwards.capacity_bucket(small + 1)


def test_failed_compilation_falls_back_to_eager_with_one_line(family_dir, caplog, monkeypatch):
    def broken(self, lm):
        raise RuntimeError("no C++ compiler\nsecond line")

    monkeypatch.setattr(forwards.CompiledForward, "__init__", broken)
    path = family_dir(BY_NAME["llama"])
    with caplog.at_level(logging.WARNING, logger="specdec.compile.startup"):
        target = TargetModel(ModelSpec(str(path), compile="on"))
    assert target.compiled is None
    lines = [r.getMessage() for r in caplog.records if r.name == "specdec.compile.startup"]
    assert len(lines) == 1
    assert "'llama'" in lines[0] and "RuntimeError: no C++ compiler" in lines[0] and "second line" not in lines[0]
    engine = VerifierEngine(target)
    assert _tokens(engine, None, [[1, 2, 3]], n=4) == _tokens(VerifierEngine(TargetModel(ModelSpec(str(path)))),
                                                             None, [[1, 2, 3]], n=4)


def test_compile_mode_is_checked():
    with pytest.raises(ValueError, match="compile must be one of"):
        ModelSpec("x", compile="always")


@pytest.mark.parametrize("eager_ms, compiled_ms, kept", [(10.0, 5.0, True), (5.0, 10.0, False)])
def test_auto_keeps_compiled_only_where_it_pays(tiny_family, caplog, monkeypatch, eager_ms, compiled_ms, kept):
    target = TargetModel(ModelSpec(str(tiny_family["target"])))         # its packages: the other tests' own
    times = iter([eager_ms, compiled_ms])           # compile_target times eager first, then compiled
    monkeypatch.setattr(startup, "time_step", lambda *args, **kwargs: next(times))
    with caplog.at_level(logging.INFO, logger="specdec.compile.startup"):
        result = startup.compile_target(target.lm, "auto")
    assert (result is not None) == kept
    lines = [r.getMessage() for r in caplog.records if r.name == "specdec.compile.startup"]
    assert len(lines) == 1
    assert ("compiled forwards on" in lines[0]) == kept
    assert kept or "10.00 ms compiled, 5.00 ms eager" in lines[0]


@pytest.fixture(scope="module")
def llama_step(family_dir):
    """A tiny Llama, its compiled forward (one-token graph built or loaded), and a one-token step's inputs."""
    target = TargetModel(ModelSpec(str(family_dir(BY_NAME["llama"]))))
    forward = forwards.CompiledForward(target.lm, packed=False)
    forward.warm((1,))
    return target, forward


def _one_token_logits(target, step, cache):
    with torch.inference_mode():
        target.lm.hidden(cache, torch.tensor([[5, 9, 2, 7]]), torch.arange(4)[None], None)
        return step(cache, torch.tensor([[3]]), torch.tensor([[4]]), None)[1]


def test_steps_write_the_stacked_buffer_the_layers_view(llama_step):
    target, forward = llama_step
    cache, eager_cache = forward.new_cache(8), target.lm.new_cache()
    got = _one_token_logits(target, forward.forward, cache)
    want = _one_token_logits(target, functools.partial(eager_forward, target.lm), eager_cache)
    assert torch.allclose(got, want, atol=1e-5) and kv.seq_len(cache) == kv.seq_len(eager_cache) == 5
    stack = cache.fixed_buffers.stack
    for i, (layer, eager_layer) in enumerate(zip(cache.layers, eager_cache.layers)):
        assert layer.buffers[0].data_ptr() == stack[i, 0].data_ptr()
        assert torch.allclose(stack[i, 0, :, :, :5], eager_layer.keys, atol=1e-5)
        assert torch.allclose(stack[i, 1, :, :, :5], eager_layer.values, atol=1e-5)
    assert (stack[:, :, :, :, 5:] == 0).all()                          # nothing written past the length
    with torch.inference_mode():
        kv.select_rows(cache, torch.tensor([0]))                    # layers re-allocated: not the stack's views
    assert fixed_kv.fixed_buffers(cache) is None and not forward.accepts(cache, 1)


def test_packages_are_reloaded_and_run_over_the_models_own_weights(llama_step, monkeypatch):
    target, forward = llama_step
    assert aot.package_built(aot.package_path(forward.packages, 1, forwards.MIN_CAPACITY, False))
    assert forward.packages.is_relative_to(aot.cache_dir())

    def no_build(*args):
        raise AssertionError("a package on disk was built again")

    monkeypatch.setattr(aot, "build_package", no_build)
    again = forwards.CompiledForward(target.lm, packed=False)     # a restart: loads the package
    again.warm((1,))
    before = _one_token_logits(target, again.forward, again.new_cache(8))
    head = target.lm.lm_head.weight
    with torch.no_grad():
        head.mul_(2.0)                                      # the packages read the parameters in place
    try:
        doubled = _one_token_logits(target, again.forward, again.new_cache(8))
    finally:
        with torch.no_grad():
            head.div_(2.0)
    assert torch.allclose(doubled, 2 * before, rtol=1e-4, atol=1e-4)


def test_a_packages_library_stands_in_for_it_and_a_rebuilt_package_replaces_it(llama_step, tmp_path):
    target, forward = llama_step
    path = aot.package_path(forward.packages, 1, forwards.MIN_CAPACITY, packed=False)
    library = aot.kept_library(path)              # (the warm-up loaded it: unzipped already)
    assert library == path.with_suffix(".so") and not path.exists() and aot.package_built(path)
    kept = library.read_bytes()
    # a package rebuilt (or left by an older start): its library replaces the kept one, one copy stays
    package = tmp_path / path.name
    with zipfile.ZipFile(package, "w") as archive:
        archive.writestr("build/data/aotinductor/model/step.wrapper.so", kept)
        archive.writestr("build/data/aotinductor/model/step.wrapper.cpp", "// source")
    stale = tmp_path / "stale.so"
    stale.write_bytes(b"an older library")
    library_copy = tmp_path / library.name
    os.replace(stale, library_copy)
    assert aot.kept_library(package).read_bytes() == kept and not package.exists()
    assert aot.kept_library(package) == library_copy          # the library alone now
    with pytest.raises(FileNotFoundError):
        aot.kept_library(tmp_path / "missing.pt2")
    # two steps over one library run side by side, each over the weights it was given
    weights = aot.shared_weights(forward.module)
    doubled = dict(weights, **{name: 2 * t for name, t in weights.items() if name.endswith("lm_head.weight")})
    one, two = aot.load_package(path, weights), aot.load_package(path, doubled)
    with torch.inference_mode():                 # (each on inputs of its own: a step writes its cache input)
        logits_one = one(*forward._example(1, forwards.MIN_CAPACITY))[1]
        logits_two = two(*forward._example(1, forwards.MIN_CAPACITY))[1]
    assert torch.allclose(logits_two, 2 * logits_one, rtol=1e-4, atol=1e-4)


def test_package_key_follows_the_model_files_or_its_layout(family_dir):
    """Packed packages hold the weights: keyed by the model's files. Shared
    ones hold none: any model of the same architecture and layout shares them."""
    a = TargetModel(ModelSpec(str(family_dir(BY_NAME["llama"], seed=0)))).lm
    b = TargetModel(ModelSpec(str(family_dir(BY_NAME["llama"], seed=1)))).lm
    step = forwards.FixedStep(a)
    cpu = torch.device("cpu")
    packed = {aot.package_dir(step, lm.model, lm.dtype, cpu, packed=True) for lm in (a, a, b)}
    shared = {aot.package_dir(step, lm.model, lm.dtype, cpu) for lm in (a, a, b)}
    assert len(packed) == 2 and len(shared) == 1 and not packed & shared
    assert aot.package_dir(step, a.model, torch.float16, cpu) not in shared
    eps = a.model.config.rms_norm_eps
    try:                                                 # a setting the trace reads is part of the layout
        a.model.config.rms_norm_eps = eps * 2
        assert aot.package_dir(step, a.model, a.dtype, cpu) not in shared
    finally:
        a.model.config.rms_norm_eps = eps


def test_a_shared_package_built_over_one_model_serves_another_of_its_layout(llama_step, family_dir, monkeypatch):
    target, forward = llama_step
    other = TargetModel(ModelSpec(str(family_dir(BY_NAME["llama"], seed=3))))

    def no_build(*args):
        raise AssertionError("a package of this layout is on disk already")

    monkeypatch.setattr(aot, "build_package", no_build)
    theirs = forwards.CompiledForward(other.lm, packed=False)
    assert theirs.packages == forward.packages
    theirs.warm((1,))
    got = _one_token_logits(other, theirs.forward, theirs.new_cache(8))
    want = _one_token_logits(other, functools.partial(eager_forward, other.lm), other.lm.new_cache())
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, _one_token_logits(target, forward.forward, forward.new_cache(8)), atol=1e-3)


def test_starts_needing_one_package_build_it_once(tmp_path, monkeypatch):
    """A start that finds a package being built waits for it and loads it."""
    import threading
    import time

    built = []

    def slow_build(step, example, path, packed, dynamic_shapes=None):
        built.append(path)
        time.sleep(0.3)                      # the other start arrives while this one builds
        path.write_bytes(b"package")

    monkeypatch.setattr(aot, "build_package", slow_build)
    paths = []
    starts = [threading.Thread(target=lambda: paths.append(aot.ensure_package(None, tuple, tmp_path, 1, 256, False)))
              for _ in range(3)]
    for t in starts:
        t.start()
    for t in starts:
        t.join()
    assert len(built) == 1 and len(set(paths)) == 1 and paths[0].read_bytes() == b"package"


def test_built_packages_are_counted_and_a_failed_build_is_not(monkeypatch, tmp_path):
    """``aot.BUILT`` counts the packages this process wrote (the bench warns when
    the count moves inside its timed runs); a build that fails writes and counts nothing."""
    from pathlib import Path

    def compile_ok(exported, package_path, inductor_configs):
        Path(package_path).write_bytes(b"package")

    def compile_fails(exported, package_path, inductor_configs):
        raise RuntimeError("inductor failed")

    step, example = torch.nn.Linear(3, 2), (torch.ones(1, 3),)
    before = aot.BUILT[0]
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", compile_ok)
    aot.build_package(step, example, tmp_path / "a.pt2", packed=True)
    assert aot.BUILT[0] == before + 1 and (tmp_path / "a.pt2").read_bytes() == b"package"
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", compile_fails)
    with pytest.raises(RuntimeError, match="inductor failed"):
        aot.build_package(step, example, tmp_path / "b.pt2", packed=True)
    assert aot.BUILT[0] == before + 1 and not (tmp_path / "b.pt2").exists()
