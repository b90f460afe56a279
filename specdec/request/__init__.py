"""The request layer, torch-free: what a client may ask for and the loop that serves it.

Parameters and their validation (``params``), named static tree shapes a
request may pick (``tree_shapes``), default knobs (``knobs``), errors that
carry a client status (``errors``), the speculative loop (``speculative``),
the bookkeeping of one generation (``decoding``) and the conversions between
``specdec.v1`` messages and these types (``wire``).

May import: ``specdec.v1`` and the standard library. Never torch,
transformers or numpy (import-linter's ``torch-free`` contract), so the
orchestrator and the SDK can run it on a CPU-only image.
"""
