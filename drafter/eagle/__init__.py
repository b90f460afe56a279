"""EAGLE heads as drafters: the EAGLE-1/2 feature head and the EAGLE-3 head.

``eagle2_head`` and ``eagle3_head`` are the heads in their released
checkpoint layouts (``eagle3_layouts`` reads every EAGLE-3 layout into one
form); ``eagle2`` and ``eagle3`` are the drafters that run them over the
target's features.

May import: ``drafter.base``, ``specdec`` core packages. Never another service.
"""
