"""target_probs filters against brute-force references; params; generators."""

import math

import pytest
import torch

from specdec.request.params import SamplingParams
from specdec.tree.sampling import make_generator, sample, target_probs


def _softmax_over(logits: list[float], keep: set[int]) -> list[float]:
    top = max(logits[i] for i in keep)
    weights = [math.exp(logits[i] - top) if i in keep else 0.0 for i in range(len(logits))]
    total = sum(weights)
    return [w / total for w in weights]


def _reference(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    # Plain Python, one row: temperature, keep the k largest, then the
    # smallest most-likely prefix reaching top_p, renormalise.
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = set(order[:top_k] if top_k > 0 else order)
    probs = _softmax_over(scaled, keep)
    nucleus, mass = set(), 0.0
    for i in sorted(keep, key=lambda i: -probs[i]):
        nucleus.add(i)
        mass += probs[i]
        if mass >= top_p:
            break
    return _softmax_over(scaled, nucleus)


def _random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 2.0


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [
        (1.0, 5, 1.0),
        (1.0, 1, 1.0),
        (0.7, 0, 0.9),
        (1.3, 0, 0.5),
        (1.0, 0, 1e-6),
        (0.8, 12, 0.8),
        (2.0, 3, 0.95),
    ],
)
def test_filters_match_brute_force(temperature, top_k, top_p):
    logits = _random_logits(64, 40, seed=top_k * 100 + int(top_p * 10))
    got = target_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    assert got.dtype == torch.float32 and got.shape == logits.shape
    for row, got_row in zip(logits.tolist(), got):
        want = torch.tensor(_reference(row, temperature, top_k, top_p))
        torch.testing.assert_close(got_row, want, rtol=1e-5, atol=1e-6)
        assert torch.equal(got_row > 0, want > 0), "filters kept a different token set"


def test_filters_count_kept_tokens():
    logits = _random_logits(32, 50, seed=1)
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=7))
    assert ((probs > 0).sum(-1) == 7).all()
    # A tiny nucleus keeps only the most likely token.
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_p=1e-9))
    assert ((probs > 0).sum(-1) == 1).all()
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))


def test_top_k_keeps_exactly_k_on_ties():
    logits = torch.zeros(3, 10)
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=4))
    assert ((probs > 0).sum(-1) == 4).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))


def test_top_k_at_or_above_vocab_is_off():
    logits = _random_logits(4, 9, seed=2)
    off = target_probs(logits, SamplingParams(temperature=1.0))
    for k in (9, 50):
        on = target_probs(logits, SamplingParams(temperature=1.0, top_k=k))
        torch.testing.assert_close(on, off)


def test_temperature_scales_logits():
    logits = _random_logits(8, 30, seed=3)
    for t in (0.25, 1.0, 3.0):
        got = target_probs(logits, SamplingParams(temperature=t))
        torch.testing.assert_close(got, torch.softmax(logits / t, -1))
    # Lower temperature sharpens: the top token gains mass.
    cold = target_probs(logits, SamplingParams(temperature=0.5)).max(-1).values
    hot = target_probs(logits, SamplingParams(temperature=2.0)).max(-1).values
    assert (cold > hot).all()


def test_greedy_is_one_hot_argmax_in_fp32():
    logits = _random_logits(2 * 3, 17, seed=4).reshape(2, 3, 17).to(torch.bfloat16)
    params = SamplingParams(temperature=0.0, top_k=3, top_p=0.5)
    assert params.greedy
    probs = target_probs(logits, params)
    assert probs.dtype == torch.float32 and probs.shape == (2, 3, 17)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.float().argmax(-1), 17).float())


def test_minus_inf_logits_get_zero_probability():
    logits = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")]])
    probs = target_probs(logits, SamplingParams(temperature=0.7, top_p=0.99))
    assert probs[0, 1] == 0 and probs[0, 3] == 0
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_p=1.5), "top_p"),
        (dict(temperature=1.0, top_p=float("nan")), "top_p"),
        (dict(temperature=1.0, top_k=-1), "top_k"),
    ],
)
def test_validate_names_the_field(kwargs, field):
    params = SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=field):
        params.validate()
    with pytest.raises(ValueError, match=field):
        target_probs(torch.zeros(1, 4), params)


def test_validate_accepts_valid_params():
    for params in (
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=3),
        SamplingParams(temperature=1.0, top_p=1.0),
    ):
        params.validate()
    assert SamplingParams().greedy and not SamplingParams(temperature=0.1).greedy


def test_seeded_generator_reproduces_draws():
    probs = target_probs(_random_logits(1, 20, seed=5)[0], SamplingParams(temperature=1.0))
    draws = lambda g: [sample(probs, g) for _ in range(50)]  # noqa: E731
    assert draws(make_generator(1234)) == draws(make_generator(1234))
    assert draws(make_generator(1234)) != draws(make_generator(4321))
    assert make_generator(1234).initial_seed() == 1234


def test_unseeded_generator_exposes_a_fresh_seed():
    a, b = make_generator(None), make_generator(None)
    assert a.initial_seed() != b.initial_seed()
    probs = torch.full((30,), 1 / 30)
    replay = make_generator(a.initial_seed())
    assert [sample(probs, a) for _ in range(20)] == [sample(probs, replay) for _ in range(20)]


def test_sample_follows_probs_and_skips_zeros():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    g = make_generator(7)
    n = 4000
    counts = torch.bincount(torch.tensor([sample(probs, g) for _ in range(n)]), minlength=5)
    assert counts[1] == 0 and counts[4] == 0
    # Within ~5 standard deviations of the expected counts.
    expected = probs * n
    std = (n * probs * (1 - probs)).sqrt()
    assert ((counts - expected).abs() <= 5 * std + 1e-9).all()
