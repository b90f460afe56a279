"""Compiled drafting of feature heads (``--compile`` on the drafter).

``head_levels`` compiles one draft level of an EAGLE head; ``whole_draft``
runs a whole EAGLE-2 draft at a fixed budget as one graph.

May import: ``drafter.base``, ``drafter.eagle``, ``specdec.compile`` and the core.
"""
