"""The orchestrator: the public gRPC API, the accept/commit loop over a drafter
and a verifier service, and text handling. Imports no torch (see DESIGN.md §1).

May import: ``specdec.serving`` (metrics, logs), ``specdec.request``,
``specdec.v1``. Never torch, ``drafter`` or ``verifier``.
"""
