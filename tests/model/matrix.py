"""The family x method matrix with τ, as a markdown table:
``python tests/model/matrix.py`` (``--new N`` tokens per prompt).

For every family of the test matrix (``families.FAMILIES``, fp32, in-process)
and every tree method, the mean τ (tokens committed per verify, the bonus
token counted; vanilla is 1) with two drafters: a draft LM that is a copy of
the target, and the n-gram drafter over the prompt. Every run is also checked
token-identical to vanilla; the last column says whether all of a family's
were. The models are the matrix's tiny random-weight ones, so τ measures the
machinery (the copy's drafts are the target's own choices), not a real
drafter's quality.
"""

from __future__ import annotations

import argparse

import torch
from families import FAMILIES, build_model

from specdec.local import generate
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from drafter.draft_lm import DraftLmDrafter
from drafter.ngram import NgramDrafter
from verifier.engine import TargetModel, VerifierEngine

VOCAB = 64
METHODS = ("eagle2", "chain", "static")


def prompts() -> list[list[int]]:
    """Random prompts whose first tokens repeat at the end (the n-gram drafter finds matches)."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for n in (5, 9, 14):
        body = torch.randint(1, VOCAB, (n,), generator=gen).tolist()
        out.append(body + body[:4])
    return out


def family_row(family, new: int) -> tuple[dict[tuple[str, str], float], bool]:
    """{(method, drafter): mean τ over the prompts}, and whether every run equalled vanilla."""
    verifier = VerifierEngine(TargetModel(ModelSpec("unused"), model=build_model(family, VOCAB)))
    drafters = {"copy": DraftLmDrafter(model=build_model(family, VOCAB)), "ngram": NgramDrafter(VOCAB)}
    stop, greedy = StopCriteria(max_new_tokens=new), SamplingParams()
    taus: dict[tuple[str, str], list[float]] = {}
    identical = True
    for prompt in prompts():
        want = generate(verifier, None, prompt, greedy, stop, None).tokens
        for method in METHODS:
            cfg = TreeParams(method=method, total_tokens=10, depth=4, expand_k=3)
            for name, drafter in drafters.items():
                run = generate(verifier, drafter, prompt, greedy, stop, cfg)
                identical &= run.tokens == want
                taus.setdefault((method, name), []).append(run.stats.tau)
    return {key: sum(v) / len(v) for key, v in taus.items()}, identical


def table(new: int) -> str:
    head = " | ".join(f"{m} {d}" for m in METHODS for d in ("copy", "ngram"))
    rows = [f"| family | {head} | identical to vanilla |", "|---" * (2 + 2 * len(METHODS)) + "|"]
    for family in FAMILIES:
        taus, identical = family_row(family, new)
        cells = " | ".join(f"{taus[m, d]:.2f}" for m in METHODS for d in ("copy", "ngram"))
        rows.append(f"| {family.name} | {cells} | {'yes' if identical else 'NO'} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=32, help="new tokens per prompt")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with torch.inference_mode():
        print(table(args.new))


if __name__ == "__main__":
    main()
