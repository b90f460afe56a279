"""Draft trees, and deciding which of their tokens the target keeps.

Building EAGLE-2 dynamic trees and their baselines (``build``), the flattened
layout every component exchanges (``layout``), trees cut to what a verify
costs (``sizing``), sampled proposals from the draft model (``proposals``),
the target's processed distribution and draws (``sampling``) and lossless
acceptance of a tree against it (``acceptance``).

May import: torch, ``specdec.request``. Never a model, a service or gRPC.
"""
