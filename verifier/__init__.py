"""specdec verifier: hosts the target model and verifies draft trees in one forward.

May import: ``specdec.serving``, ``specdec.compile``, ``specdec.model``,
``specdec.tree``, ``specdec.request``. Never ``drafter`` or ``orchestrator``.
"""
