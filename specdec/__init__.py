"""specdec: lossless speculative decoding (EAGLE-2 dynamic draft trees) as services.

The shared package, as packages named for their layers (DESIGN.md §9), top
to bottom: the application (``cli``, ``train``, ``bench``, ``soak``, and the
modules ``procs`` and ``local`` beside them), then what the services share
(``serving``) and the client SDK (``client``), compiled forwards
(``compile``), running a model (``model``) and draft trees (``tree``), the
torch-free request layer (``request``) and the generated messages (``v1``).
``protos_build`` regenerates ``v1`` (``make protos``).

May import: each package only those below its layer; the import contracts
in pyproject.toml (``tests/test_layers.py``) hold each package to it.
"""

__version__ = "0.1.0"
