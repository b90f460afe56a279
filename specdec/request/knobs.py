"""Default knobs: one torch-free place for every component (the tree
builder, the CLI, the orchestrator, the deployment ConfigMap). The methods,
the proposal modes and every bound live in ``specdec.request.params``.

The defaults are CPU-sized (small trees win when a verify of n tokens costs
noticeably more than a verify of one); ``specdec bench sweep`` measures the
trade-off on your hardware.
"""

DEFAULT_METHOD = "eagle2"       # one of specdec.request.params.METHODS
DEFAULT_PROPOSALS = "auto"      # one of specdec.request.params.PROPOSALS
# `specdec bench sweep` on the 2-core CPU with the demo family: tokens/s is
# flat from 12 to 32 nodes, and over depth peaks on a plateau from 6 to 8.
DEFAULT_TOTAL_TOKENS = 16     # nodes incl. the root
DEFAULT_DEPTH = 6             # deepest draft level
DEFAULT_EXPAND_K = 4          # top-k per expansion
# Pause drafting while a session's recent cycles commit fewer tokens than this
# (specdec.request.decoding.SpeculationGate). On the 2-core CPU a 16-node EAGLE cycle
# costs ~2.3 one-token steps; on a GPU the break-even is nearer 1.2-1.5.
DEFAULT_MIN_TAU = 2.0
# How a verifier sizes greedy sessions' trees (specdec.tree.sizing): "cost"
# keeps per cycle the nodes of the drafted tree that repay their measured
# verify time, "fixed" verifies every tree as drafted. Fixed by default: on
# the 2-core CPU with the demo family the two run within 1% of each other at
# 16 and at 32 nodes (docs/bench/compile.md), and fixed trees keep a run's
# tau reproducible.
TREE_SIZINGS = ("cost", "fixed")
DEFAULT_TREE_SIZING = "fixed"
# The widest tree a verifier builds compiled graphs for (verifier serve
# --compile-tree-tokens): the widest of specdec.compile.fixed_graphs.WIDTHS.
MAX_COMPILED_TREE = 64


def check_tree_sizing(mode: str) -> str:
    """A tree sizing mode (one of TREE_SIZINGS); ValueError naming the choices otherwise."""
    if mode not in TREE_SIZINGS:
        raise ValueError(f"must be one of {', '.join(TREE_SIZINGS)}, got {mode!r}")
    return mode
# An n-gram drafter costs next to nothing, so drafting pays as soon as the
# committed tokens cover the larger tree forward: its break-even is lower.
# Lookahead decoding drafts inside the verify (no drafter call) with a forward
# as wide as a default tree ((W + G)(N - 1) = 16 tokens): the same break-even.
NGRAM_MIN_TAU = 1.3


def default_min_tau(drafter_kind: str | None) -> float:
    """The speculation gate's threshold for a drafter kind ("eagle", "draft-lm", "ngram", "lookahead")."""
    return NGRAM_MIN_TAU if drafter_kind in ("ngram", "lookahead") else DEFAULT_MIN_TAU


def parse_min_tau(text: str) -> float | None:
    """A --min-tau value: a number >= 0 (0 = always draft) or "auto" (None: by drafter kind)."""
    if str(text).strip().lower() == "auto":
        return None
    value = float(text)
    if not value >= 0:
        raise ValueError(f"must be >= 0 or auto, got {text}")
    return value
# Accepted paths the drafter drafts the next round for while the verifier
# checks a greedy session's tree (drafting one round ahead; each path gives one
# tree per bonus candidate); on a hit the next Draft round trip is skipped.
# Off by default: on the 2-core CPU the drafter and the verifier share the
# cores; with the demo family one path had the next tree ready on 25-34% of
# cycles and gained 2-14%, two paths lost. It is meant for a drafter on its
# own device; measure with `specdec bench --grpc --lookahead N`.
DEFAULT_LOOKAHEAD = 0
