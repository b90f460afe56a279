"""A model specdec cannot serve correctly is refused at load with one line
naming its type and the reason, never a shape error mid-generation; the
attention implementation override is validated the same way."""

import pytest
from families import BY_NAME, REFUSED

from specdec.cli.main import main
from specdec.model.loading import ModelSpec


@pytest.mark.parametrize("family", REFUSED, ids=lambda f: f.name)
def test_unsupported_model_is_refused_in_one_line(family, family_dir, capsys):
    path = family_dir(family)
    capsys.readouterr()                          # building the model is not under test
    assert main(["generate", "--local", "--target", str(path), "--ngram", "--max-new-tokens", "4", "x = "]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"specdec: error: model type {family.name!r} cannot be served: layers of type linear_attention "
                   f"keep state that cannot be rolled back slot by slot")


def test_attention_override_is_validated(family_dir, capsys):
    gemma2 = str(family_dir(BY_NAME["gemma2"]))
    capsys.readouterr()
    # soft-capped attention has no SDPA path in transformers: an explicit sdpa is refused at load
    assert main(["generate", "--local", "--target", gemma2, "--ngram", "--attn-implementation", "sdpa",
                 "--max-new-tokens", "4", "x = "]) == 2
    assert capsys.readouterr().err.strip() == ("specdec: error: Gemma2ForCausalLM has no SDPA attention in "
                                               "transformers (use --attn-implementation eager or auto)")
    assert main(["generate", "--local", "--target", gemma2, "--ngram", "--attn-implementation", "eager",
                 "--max-new-tokens", "4", "x = "]) == 0
    with pytest.raises(ValueError, match="must be one of auto, sdpa, eager, got 'flash'"):
        ModelSpec(gemma2, attn_implementation="flash")
