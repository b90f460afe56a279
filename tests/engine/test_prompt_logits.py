"""A prompt's forward runs the output head over its last token only, unless
every prompt token is scored (``prompt_logprobs``): the first token, its
logprobs and the prompt's scores are those of the full forward, with the
prefix cache on or off, eager, compiled and over int8 weights."""

from __future__ import annotations

import pytest
import torch

from specdec.model.loading import ModelSpec
from specdec.request.params import SamplingParams
from verifier.engine import TargetModel, VerifierEngine

PROMPT = [(5 * i) % 50 + 3 for i in range(40)]          # past PROMPT_ROWS (int8 prompts run dense)


def head_rows(target: TargetModel) -> list[int]:
    """The rows each call of ``target``'s output head multiplies, recorded from now on."""
    rows: list[int] = []
    target.lm.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[:-1].numel()))
    return rows


@pytest.mark.parametrize("weights, prefix, tol", [("dtype", 0, 1e-4), ("dtype", 16, 1e-4),
                                                  # int8: a one-row head takes the kernel, the full one
                                                  # the dense bf16 product (``specdec.model.quantize``)
                                                  ("int8", 0, 2e-2)])
def test_a_prefill_runs_the_head_over_its_last_token(tiny_family, weights, prefix, tol):
    target = TargetModel(ModelSpec(str(tiny_family["target"]), weights=weights))
    engine = VerifierEngine(target, prefix_cache_tokens=prefix * 8)
    with torch.inference_mode():
        _, full = target.forward(target.new_cache(), torch.tensor(PROMPT), torch.arange(len(PROMPT)), None)
    rows = head_rows(target)
    first = engine.prefill("a", PROMPT, SamplingParams(), logprobs=2)
    assert rows and max(rows) == 1
    assert first.token == int(full[-1].argmax())
    assert first.logprobs[0].logprob == pytest.approx(float(torch.log_softmax(full[-1], -1)[first.token]), abs=tol)


def test_prompt_logprobs_still_score_every_prompt_token_and_leave_the_next_tokens_bits(tiny_family):
    """Scoring the prompt multiplies its other rows apart from the last, whose
    product (and so the first token's logprobs) is the very one of a plain prefill."""
    target = TargetModel(ModelSpec(str(tiny_family["target"])))
    engine = VerifierEngine(target)
    with torch.inference_mode():
        _, full = target.forward(target.new_cache(), torch.tensor(PROMPT), torch.arange(len(PROMPT)), None)
    plain = engine.prefill("plain", PROMPT, SamplingParams(), logprobs=3)
    rows = head_rows(target)
    out = engine.prefill("a", PROMPT, SamplingParams(), prompt_logprobs=1, logprobs=3)
    assert sorted(rows) == [1, len(PROMPT) - 1]
    want = torch.log_softmax(full[:-1], -1).gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    got = torch.tensor([entry.logprob for entry in out.prompt_logprobs])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert out.token == plain.token and out.logprobs == plain.logprobs          # equal to the last bit


def test_the_last_token_logits_are_the_full_forwards_last_row(tiny_family):
    """Compiled forwards (which return every row) are cut to the last one too."""
    for compile in ("off", "on"):
        target = TargetModel(ModelSpec(str(tiny_family["target"]), compile=compile))
        with torch.inference_mode():
            feats, full = target.forward(target.new_cache(), torch.tensor(PROMPT), torch.arange(len(PROMPT)), None)
            last_feats, last = target.forward(target.new_cache(), torch.tensor(PROMPT), torch.arange(len(PROMPT)),
                                              None, last_logits=True)
        assert last.shape == (1, full.shape[-1]) and last_feats.shape == feats.shape
        torch.testing.assert_close(last[0], full[-1], atol=1e-4, rtol=0)


def test_a_draft_lm_runs_its_head_over_a_prompts_last_token(tiny_family):
    """The draft LM's prompt (and each commit fed to it) needs its last row's
    log-probs only: the tree's first level is the top of the full forward's last row."""
    from drafter.draft_lm import DraftLmDrafter
    from specdec.request.params import TreeParams

    drafter = DraftLmDrafter(ModelSpec(str(tiny_family["draft-lm"])))
    with torch.inference_mode():
        out = drafter.lm.hidden(drafter.new_cache(), torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None], None)
        top = set(drafter.logprobs(out[0])[-1].topk(2).indices.tolist())
    rows: list[int] = []
    drafter.lm.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[:-1].numel()))
    drafter.prefill("a", PROMPT, greedy=True)
    tree = drafter.draft("a", TreeParams(total_tokens=8, depth=3, expand_k=2))
    assert rows and rows[0] == 1 and max(rows) < len(PROMPT)
    assert set(tree.tokens[tree.parents == 0].tolist()) == top
