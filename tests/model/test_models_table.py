"""docs/models.md lists exactly the families the test matrix runs."""

from families import DOCS, render


def test_models_doc_is_generated_from_the_matrix():
    text = DOCS.read_text()
    assert text == render(text), "docs/models.md is stale: run `python tests/model/families.py`"
