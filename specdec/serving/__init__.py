"""What every specdec gRPC service shares.

The server with health, reflection, TLS and auth (``server``), the
interceptor every server runs (``interceptor``), the base servicer that owns
one engine and its worker thread (``engine_servicer``), the session table
with caps, TTLs and leases (``sessions``), batching of concurrent calls
(``batching``), Prometheus metrics (``metrics``), JSON-lines logs (``logs``)
and tensors and trees to and from their messages (``tensor_wire``).

May import: gRPC, torch, ``specdec.tree``, ``specdec.request``, ``specdec.v1``.
Never the client SDK, nor a service (drafter, verifier, orchestrator).
"""
