"""specdec: lossless speculative decoding (EAGLE-2 dynamic draft trees) as services.

The top-level package is the shared core: tree math, acceptance, sampling,
wire conversion, configuration, metrics, the client SDK and the CLI.
"""

__version__ = "0.1.0"
