"""Training the demo family and EAGLE heads (``specdec train``): data, loops, model cards.

May import: ``specdec.bench`` (to measure what it trained), the drafters and
the core packages. Never the CLI.
"""
