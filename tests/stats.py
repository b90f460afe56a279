"""Goodness-of-fit helpers for the losslessness tests."""

import os
from collections import Counter

import torch


def chi2_runs(n: int) -> int:
    """The seeds a chi-square test draws: ``n``, times ``SPECDEC_CHI2_SCALE``
    (default 1). Each file's ``n`` is sized so that its planted-bug controls
    are still caught with half of it (``SPECDEC_CHI2_SCALE=0.5 make test``);
    ``make bench`` runs the sampling checks at 4x for subtler departures."""
    return max(1, round(n * float(os.environ.get("SPECDEC_CHI2_SCALE", "1"))))


def chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof)."""
    try:
        from scipy.stats import chi2
    except ImportError:
        return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                             torch.tensor(stat / 2, dtype=torch.float64)))
    return float(chi2.sf(stat, dof))


def chi2_pvalue(observed: Counter, expected_p: dict, n: int) -> float:
    """Goodness of fit of `observed` counts to cell probabilities `expected_p`.

    Any observation in a cell of probability 0 fails outright; cells expected
    fewer than 5 times are pooled so the chi-square approximation holds; a
    single possible cell (nothing to test) gives 1.
    """
    if any(expected_p.get(cell, 0.0) <= 0.0 for cell in observed):
        return 0.0
    cells, rare_obs, rare_exp = [], 0, 0.0
    for cell, prob in expected_p.items():
        if prob * n >= 5:
            cells.append((observed.get(cell, 0), prob * n))
        else:
            rare_obs, rare_exp = rare_obs + observed.get(cell, 0), rare_exp + prob * n
    if rare_exp > 0:
        cells.append((rare_obs, rare_exp))
    if len(cells) < 2:
        return 1.0
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return chi2_sf(stat, len(cells) - 1)
