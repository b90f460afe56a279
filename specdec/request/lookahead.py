"""Lookahead decoding's parameters, torch-free (the CLI parses them; the method
itself is ``specdec.tree.lookahead``): W the Jacobi window, N the n-gram size,
G the guesses per cycle, as in the paper (arXiv 2402.02057) and TensorRT-LLM."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_WINDOW, DEFAULT_NGRAM, DEFAULT_GUESSES = 4, 3, 4     # TensorRT-LLM's defaults
MAX_LOOKAHEAD_TOKENS = 64      # (W + G)(N - 1): one forward's width at most (the widest compiled tree)


@dataclass(frozen=True)
class LookaheadParams:
    """W, N, G: window, n-gram size, guesses (the pool's n-grams per key and the tree's at most)."""

    window: int = DEFAULT_WINDOW
    ngram: int = DEFAULT_NGRAM
    guesses: int = DEFAULT_GUESSES

    def __post_init__(self):
        for name, low in (("window", 1), ("ngram", 2), ("guesses", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"lookahead {name} must be an integer >= {low}, got {value!r}")
        if self.width > MAX_LOOKAHEAD_TOKENS:
            raise ValueError(f"lookahead W,N,G = {self}: one forward of (W + G)(N - 1) = {self.width} tokens "
                             f"is over {MAX_LOOKAHEAD_TOKENS}")

    @property
    def cells(self) -> int:
        """Window cells in a forward (the root excluded): (W - 1) + (N - 2) W."""
        return self.window * (self.ngram - 1) - 1

    @property
    def width(self) -> int:
        """Tokens of one forward at most: the root, G (N - 1) guess nodes and the cells."""
        return (self.window + self.guesses) * (self.ngram - 1)

    def __str__(self) -> str:
        return f"{self.window},{self.ngram},{self.guesses}"


def parse_lookahead(text: str) -> LookaheadParams:
    """``W,N,G`` (e.g. ``4,3,4``) as LookaheadParams; ValueError naming the form otherwise."""
    try:
        window, ngram, guesses = (int(p) for p in str(text).split(","))
    except ValueError:
        raise ValueError(f"must be W,N,G (three integers, e.g. 4,3,4), got {text!r}") from None
    return LookaheadParams(window, ngram, guesses)
