"""The orchestrator: the public gRPC API, the accept/commit loop over a drafter
and a verifier service, and text handling. Imports no torch (see DESIGN.md §1)."""
