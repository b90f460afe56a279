"""specdec drafter: builds draft trees with an EAGLE head, a small LM or n-grams.

May import: ``specdec.serving``, ``specdec.compile``, ``specdec.model``,
``specdec.tree``, ``specdec.request``. Never ``verifier`` or ``orchestrator``.
"""
