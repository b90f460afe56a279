"""``specdec train eagle --target DIR`` trains a head for non-Llama targets
(GPT-2: learned positions, tied embeddings; Gemma-3: hybrid sliding layers,
scaled embeddings, final soft-cap; MPT: ALiBi) through transformers' public
API, and the EAGLE drafter, reading the target's embedding and output head the
same way, drafts with it token-identical to vanilla."""

import pytest
from families import BY_NAME

from specdec.cli.main import main
from specdec.local import generate
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from drafter.eagle.eagle2 import EagleDrafter
from verifier.engine import TargetModel, VerifierEngine

TEXT = "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\n\n"


@pytest.mark.parametrize("name", ["gpt2", "gemma3", "mpt"])
def test_trained_head_drafts_and_stays_identical(name, family_dir, tmp_path):
    target = family_dir(BY_NAME[name])
    data = tmp_path / "corpus.py"
    data.write_text(TEXT * 40)
    head = tmp_path / "eagle"
    assert main(["train", "eagle", "--data", str(data), "--target", str(target), "--out", str(head),
                 "--workdir", str(tmp_path / "work"), "--steps", "20", "--batch", "4", "--seq-len", "32",
                 "--eval-every", "20", "--no-progress", "--threads", "1"]) == 0
    verifier = VerifierEngine(TargetModel(ModelSpec(str(target))))
    drafter = EagleDrafter(head, target)
    stop = StopCriteria(max_new_tokens=24)
    cfg = TreeParams(total_tokens=10, depth=4, expand_k=3)
    for prompt in ([5, 17, 33, 5, 17, 9], [40, 41, 42, 43, 40, 41, 42, 43, 40, 41]):
        want = generate(verifier, None, prompt, SamplingParams(), stop, None).tokens
        got = generate(verifier, drafter, prompt, SamplingParams(), stop, cfg)
        assert got.tokens == want
        assert got.stats.drafted > 0
