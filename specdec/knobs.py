"""Tree methods and default knobs: one torch-free place for every component
(the tree builder, the CLI, the orchestrator, the deployment ConfigMap).

The defaults are CPU-sized (small trees win when a verify of n tokens costs
noticeably more than a verify of one); ``specdec bench sweep`` measures the
trade-off on your hardware.
"""

METHODS = ("eagle2", "static", "chain", "no-value", "no-rerank")

DEFAULT_METHOD = "eagle2"
DEFAULT_TOTAL_TOKENS = 16     # nodes incl. the root
DEFAULT_DEPTH = 5             # deepest draft level
DEFAULT_EXPAND_K = 4          # top-k per expansion
