"""Weight-only quantized linear layers (``--weights int8|int4``,
``specdec.model.quantize``): the layers multiply by the weights they hold; a
tied head is quantized while the embedding stays; a layer int4 cannot pack is
held in int8 with one log line; speculation (eagle2, chain, n-gram, a draft LM)
is greedy-identical to plain decoding of the same quantized target, eager and
compiled; sampled speculation at int8 and w8a8 is distributed as that
target (chi-square); impossible combinations are refused in one line."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from stats import chi2_runs, chi2_sf

from specdec.local import DrafterChoice, build_local, generate
from specdec.model.loading import ModelSpec, load_causal_lm
from specdec.model.quantize import (GROUP, PROMPT_ROWS, Int4Linear, Int8Linear, QuantizedLinear, prompt_products,
                                    quantize_linears)
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from specdec.tree.layout import tree_from_lists
from specdec.tree.sampling import target_probs
from drafter.draft_lm import DraftLmDrafter
from drafter.ngram import NgramDrafter
from verifier.engine import TargetModel, VerifierEngine

NEW = 24
PROMPTS = [[5, 17, 33, 5, 17, 9, 40], [3, 8, 3, 8, 3, 8, 12, 60, 3],
           [(7 * i) % 61 + 2 for i in range(40)]]       # past PROMPT_ROWS: int8 prompt products run dense
SMALL_TREE = TreeParams(total_tokens=8, depth=3, expand_k=4)        # compiled verify widths 1, 4 and 16: few graphs


@pytest.fixture(scope="module")
def family(tiny_family, tmp_path_factory):
    """A tiny family whose target is 64 wide (int4 packs its decoder layers; its
    vocabulary, not a multiple of 16, keeps the head int8), with an EAGLE head for it."""
    from tiny import tiny_llama
    from transformers import AutoTokenizer

    from drafter.eagle.eagle2_head import EagleHead, head_config, save_head

    root = tmp_path_factory.mktemp("quantized")
    tok = AutoTokenizer.from_pretrained(tiny_family["target"])
    target = tiny_llama(len(tok), seed=11, hidden=64)
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    torch.manual_seed(12)
    save_head(EagleHead(head_config(target.config.to_dict())), root / "eagle", dtype=torch.float32)
    return {"target": root / "target", "eagle": root / "eagle", "draft-lm": tiny_family["draft-lm"]}


@pytest.mark.parametrize("kind", [Int8Linear, Int4Linear])
def test_a_quantized_layer_multiplies_by_its_weights(kind):
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 48, bias=True)
    q = kind(linear.weight, linear.bias)
    deq = q.dequantized()
    step = (linear.weight.detach().abs().amax(1, keepdim=True) / 127 if kind is Int8Linear else
            (linear.weight.detach().reshape(48, -1, GROUP).amax(-1) - linear.weight.detach().reshape(48, -1, GROUP)
             .amin(-1)).repeat_interleave(GROUP, 1) / 15)
    # the nearest code, up to the bf16 rounding of the scales (and minimums)
    assert ((deq - linear.weight).abs() <= step * 0.5 + linear.weight.abs().max() * 2 ** -7).all()
    x = torch.randn(2, 5, 128)
    want = x.to(torch.bfloat16).float() @ deq.t() + linear.bias
    got = q(x)
    assert got.dtype == torch.float32 and got.shape == (2, 5, 48)
    assert torch.allclose(got, want, atol=2e-2, rtol=2e-2)


def test_an_int8_layer_multiplies_a_long_prompt_densely():
    """Inside ``prompt_products``, PROMPT_ROWS rows or more: the bf16 product
    over the weights converted exactly, then scaled (two roundings, within a
    bf16 step of the packed kernel's one); fewer rows, or outside: the kernel."""
    torch.manual_seed(0)
    layer = Int8Linear(torch.randn(96, 64))
    x = torch.randn(PROMPT_ROWS, 64).to(torch.bfloat16)
    kernel = torch.ops.aten._weight_int8pack_mm(x, layer.qweight, layer.scales)
    assert torch.equal(layer.product(x), kernel)
    with prompt_products():
        dense = layer.product(x)
        assert torch.equal(layer.product(x[:-1]), kernel[:-1])
    assert torch.equal(dense, (x @ layer.qweight.to(torch.bfloat16).t()) * layer.scales)
    assert not torch.equal(dense, kernel)          # (so the two paths are told apart above)
    assert torch.allclose(dense.float(), kernel.float(), rtol=2 ** -7, atol=1e-2)


def test_int8_prefills_run_dense_and_trees_keep_the_kernel(family, monkeypatch):
    """A prompt of PROMPT_ROWS tokens or more over int8 weights runs its
    products dense (``specdec.model.quantize``), a shorter one and every tree the kernel."""
    target = TargetModel(ModelSpec(str(family["target"]), weights="int8"))
    seen = []
    product = Int8Linear.product

    def recorded(self, rows):
        out = product(self, rows)
        seen.append((rows.shape[0], torch.equal(out, torch.ops.aten._weight_int8pack_mm(rows, self.qweight,
                                                                                         self.scales))))
        return out

    monkeypatch.setattr(Int8Linear, "product", recorded)
    engine = VerifierEngine(target)
    long, short = PROMPTS[2], PROMPTS[0]
    engine.prefill("long", long, SamplingParams())
    wide = [same for rows, same in seen if rows >= PROMPT_ROWS]
    assert len(wide) >= len(target.model.model.layers) and not any(wide)         # every layer dense
    seen.clear()
    engine.prefill("short", short, SamplingParams())
    engine.verify("long", tree_from_lists([engine.committed_tokens("long")[-1]] + list(range(2, 2 + PROMPT_ROWS)),
                                          [-1] + list(range(PROMPT_ROWS))))
    assert seen and all(same for _, same in seen)                                # the kernel


def test_int4_packs_what_it_can_and_a_tied_head_keeps_its_embedding(caplog):
    from tiny import tiny_llama

    model = tiny_llama(300, seed=0, hidden=64)
    model.lm_head.weight = model.model.embed_tokens.weight          # tied
    embed = model.model.embed_tokens.weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="specdec.model.quantize"):
        kinds = quantize_linears(model, "int4")
    assert kinds["model.layers.0.self_attn.q_proj"] == "int4" and kinds["model.layers.1.mlp.down_proj"] == "int4"
    assert kinds["lm_head"] == "int8"                               # 300 outputs: not a multiple of 16
    assert [r.getMessage() for r in caplog.records if "held in int8" in r.getMessage()] == [
        f"int4 weights: 1 layer(s) held in int8 (weight-only) instead (torch's int4 packing needs the output width a multiple "
        f"of 16 and the input width a multiple of {GROUP}): lm_head [300x64]"]
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert torch.equal(model.model.embed_tokens.weight, embed)
    assert isinstance(model.lm_head, QuantizedLinear)


def test_impossible_combinations_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^--weights int4 runs on CPU only .* got device cuda:0; use --weights "
                                         r"dtype there$"):
        ModelSpec("unused", device="cuda:0", weights="int4")
    with pytest.raises(ValueError, match=r"^weights must be one of dtype, int8, int4, w8a8, got 'int2'$"):
        ModelSpec("unused", weights="int2")


def test_up_hands_the_weights_to_its_services_and_a_gpu_is_refused_in_one_line(tiny_family, capsys):
    from specdec.cli.main import build_parser, main
    from specdec.cli.up import _model_argv

    target, lm = str(tiny_family["target"]), str(tiny_family["draft-lm"])
    verifier, drafter, _ = _model_argv(build_parser().parse_args(["up", "--target", target, "--draft-lm", lm,
                                                                  "--weights", "int4"]))
    assert build_parser().parse_args(["verifier", "serve", *verifier]).weights == "int4"
    assert build_parser().parse_args(["drafter", "serve", *drafter]).weights == "int4"
    assert main(["generate", "--local", "--target", target, "--weights", "int8", "--device", "cuda:0", "x"]) == 2
    assert capsys.readouterr().err == ("specdec: error: --weights int8 runs on CPU only (the int8 kernels used "
                                       "here are CPU kernels), got device cuda:0; use --weights dtype there\n")


def _tokens(verifier, drafter, prompt, tree=None):
    stop = StopCriteria(max_new_tokens=NEW, eos_ids=frozenset())
    return generate(verifier, drafter, prompt, SamplingParams(), stop, tree).tokens


@pytest.mark.parametrize("weights", ["int8", "int4", "w8a8"])
def test_speculation_is_plain_greedy_decoding_of_the_same_quantized_weights(family, weights):
    spec = ModelSpec(str(family["target"]), weights=weights)
    stack = build_local(spec, DrafterChoice("eagle", str(family["eagle"])))
    assert isinstance(stack.verifier.target.model.lm_head, QuantizedLinear)
    ngram = NgramDrafter(stack.verifier.target.vocab_size)
    lm = DraftLmDrafter(ModelSpec(str(family["draft-lm"]), weights=weights))
    for prompt in PROMPTS:
        want = _tokens(stack.verifier, None, prompt)
        for method in ("eagle2", "chain"):
            assert _tokens(stack.verifier, stack.drafter, prompt, TreeParams(method=method)) == want, method
        assert _tokens(stack.verifier, ngram, prompt, TreeParams()) == want
        assert _tokens(stack.verifier, lm, prompt, TreeParams()) == want


def _first_difference_is_a_tie(target, prompt, got, want) -> bool:
    """``got`` is ``want``, or where it first leaves it the eager target's two
    tokens are tied to within one bfloat16 step of its top logit, on the path
    that decoded ``want`` (the prompt's forward, then one-token steps): the
    quantized kernels' output is bf16, and the compiled one-row product (an fp32
    sum over the int8 weights, ``specdec.compile.row_products``) sums in another
    order than the kernel, so an exact tie of the eager logits can round either way."""
    if got == want:
        return True
    i = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
    cache = target.new_cache(len(prompt) + i + 1)
    _, logits = target.forward(cache, torch.tensor(prompt), torch.arange(len(prompt)), None)
    for k, token in enumerate(want[:i]):
        _, logits = target.forward(cache, torch.tensor([token]), torch.tensor([len(prompt) + k]), None)
    logits = logits[-1].float()
    return float(logits[want[i]] - logits[got[i]]) <= 2 ** -7 * float(logits.abs().max())


# builds the quantized target's packages (widths 1, 4 and 16): ~2 min each on an empty compile cache, with
# ``make bench`` (the suite keeps the packages' key check below and the eager quantized checks above)
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_compiled_quantized_target_is_its_eager_plain_greedy_decoding(family, weights):
    from drafter.eagle.eagle2 import EagleDrafter

    eager = TargetModel(ModelSpec(str(family["target"]), weights=weights))
    fast = VerifierEngine(TargetModel(ModelSpec(str(family["target"]), weights=weights, compile="on")))
    assert fast.target.compiled is not None
    drafter = EagleDrafter(family["eagle"], family["target"])
    for prompt in PROMPTS:
        want = _tokens(VerifierEngine(eager), None, prompt)
        assert _first_difference_is_a_tie(eager, prompt, _tokens(fast, None, prompt), want)
        for method in ("eagle2", "chain"):
            got = _tokens(fast, drafter, prompt, replace(SMALL_TREE, method=method))
            assert _first_difference_is_a_tie(eager, prompt, got, want), method
        assert _first_difference_is_a_tie(eager, prompt, _tokens(fast, NgramDrafter(eager.vocab_size), prompt,
                                                                  SMALL_TREE), want)
    cache = fast.target.new_cache(40)
    fast.target.forward(cache, torch.tensor(PROMPTS[0]), torch.arange(len(PROMPTS[0])), None)
    assert fast.target.compiled.accepts(cache, 1) and fast.target.compiled.accepts(cache, 8)   # the compiled path


V, STEPS = 5, 3
PROMPT = [1, 3, 2]


@pytest.mark.parametrize("weights", ["int8", "w8a8"])
def test_sampled_speculation_is_distributed_as_the_quantized_target(weights):
    from tiny import tiny_llama

    target, draft = tiny_llama(V, seed=5, hidden=32), tiny_llama(V, seed=6, hidden=32)
    for m in (target, draft):
        for p in m.parameters():
            p.data.mul_(3.0)
        assert set(quantize_linears(m, weights).values()) == {weights}
    params = SamplingParams(temperature=1.0)
    joint, seqs = torch.ones(()), torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(STEPS):                    # the quantized target's exact joint of the first 3 tokens
            p = target_probs(target(seqs).logits[:, -1], params)
            joint = (joint.reshape(-1, 1) * p).reshape(-1)
            seqs = torch.cat([seqs.repeat_interleave(V, 0), torch.arange(V).repeat(len(seqs))[:, None]], 1)
    verifier = VerifierEngine(TargetModel(ModelSpec("unused"), model=target))
    drafter = DraftLmDrafter(model=draft)
    runs, counts = chi2_runs(1500), torch.zeros(V ** STEPS)
    tree, stop = TreeParams(total_tokens=6, depth=2, expand_k=2), StopCriteria(max_new_tokens=STEPS)
    for seed in range(runs):
        tokens = generate(verifier, drafter, PROMPT, SamplingParams(1.0, seed=seed), stop, tree).tokens
        counts[tokens[0] * V * V + tokens[1] * V + tokens[2]] += 1
    expected = joint.double() * runs
    small = expected < 5
    e = torch.cat([expected[~small], expected[small].sum()[None]])
    o = torch.cat([counts.double()[~small], counts.double()[small].sum()[None]])
    assert chi2_sf(float(((o - e) ** 2 / e.clamp(min=1e-12)).sum()), len(e) - 1) > 1e-3


def test_a_loaded_quantized_model_keeps_its_embedding_dtype(family):
    model = load_causal_lm(ModelSpec(str(family["target"]), dtype="bfloat16", weights="int8"))
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.layers[0].mlp.up_proj.qweight.dtype == torch.int8


def test_compiled_packages_are_keyed_by_the_quantized_layers(family):
    from specdec.compile import aot

    keys = {aot.model_fingerprint(load_causal_lm(ModelSpec(str(family["target"]), weights=w)))
            for w in ("dtype", "int8", "int4", "w8a8")}
    assert len(keys) == 4


def test_bench_profile_times_int8_prompts_both_ways(family):
    """``bench profile --prefill`` over int8 weights also times the packed
    kernel's prompt products, and leaves the target as it found it."""
    from specdec.bench import batch_profile

    target = TargetModel(ModelSpec(str(family["target"]), weights="int8"))
    result = batch_profile.prefill(target, target, (PROMPT_ROWS + 8,), steps=1)
    assert set(result[f"{PROMPT_ROWS + 8} tokens"]) == {"eager", "compiled", "int8 kernel"} and target.int8_prompts
    assert any("int8 kernel ms" in line for line in batch_profile.markdown({"prefill": result}))
    plain = TargetModel(ModelSpec(str(family["target"])))
    assert not plain.int8_prompts
    assert set(batch_profile.prefill(plain, plain, (PROMPT_ROWS + 8,), 1)[f"{PROMPT_ROWS + 8} tokens"]) == {
        "eager", "compiled"}
