"""Prefix caching: the committed KV of prompt prefixes, kept across sessions.

A prompt is cut into blocks of ``block_tokens(exact)`` model inputs; block j's key
is a hash chained over the keys before it, so a key names the whole prefix
that ends with its block (the same idea as vLLM's block hashes; a radix tree
over token ids would find the same prefixes, but blocks of a fixed size can
also be the unit the prefill runs in, see below, and a flat table of them
needs no tree surgery on eviction). Blocks are 16 inputs by default and 64,
the prefill's chunk, with ``exact``. The chain starts from a *namespace*: the
model's identity, the tenant's salt and whatever else decides what a block
holds (the verifier's feature layers), so a block is never served to a
session of another model or another tenant.

What a block holds is its owner's business (``payload``): the verifier keeps
the target's K/V and features of the block's tokens, a drafter its model's
K/V. A drafter's key is over its model's *inputs*, not the prompt's tokens: an
EAGLE head's input i is (f_i, x_{i+1}), so its block j is keyed by the
tokens up to x_{(j+1)B} and the features f_0..f_{(j+1)B-1} (``chain`` takes
each block's bytes from the caller).

Exactness. A block's K/V computed inside a longer forward and inside a
shorter one can differ in the last bits (other GEMM shapes; measured on the
demo target: a prefix's K/V from a 960-token prefill against from a
1,000-token one), and so can the logits of a suffix run over loaded K/V
against those of one long forward. By default a prefill runs what it did
not load in one forward: a hit then gives the uncached logits up to float
rounding, the same latitude batched verification already takes (a batched
forward sums in another order than a lone one), and the greedy tokens of
the uncached run. With ``exact`` a prefill runs in block-aligned chunks
(``spans``): block j is always computed by the same forward of the same
shape over the same K/V, whether its session found it cached or not, so a
hit gives the very bits a miss gives (logits, features, sampled tokens);
the price is the cold prefill's, measured in docs/benchmarks.md. A lookup
uses at most ``usable`` blocks: at least one input always runs (its output is
the first token's logits), and the run starts on a block boundary.

Eviction: least recently used under a budget of tokens; a hit touches its
blocks last to first, so a prefix's first block is the freshest and a chain is
evicted from its tail, never left headless. The owner may also evict to free
bytes for sessions (``evict_bytes``): sessions come first.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

BLOCK_TOKENS = 16           # a block's inputs: a hit loads the shared prefix but for its last < 16 inputs
EXACT_BLOCK_TOKENS = 64     # ``exact``: the compiled prefill's chunk width (``specdec.compile.forwards.PREFILL_WIDTH``)
DEFAULT_TOKENS = 8192       # the serving default of ``--prefix-cache-tokens``


def block_tokens(exact: bool) -> int:
    """A block's inputs: small by default (a hit leaves less of its prefix to
    run, measured in docs/benchmarks.md), the prefill's chunk with ``exact``
    (one forward per block, so fewer and wider forwards on a miss)."""
    return EXACT_BLOCK_TOKENS if exact else BLOCK_TOKENS


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def namespace(*parts: object) -> bytes:
    """The root of every chain of one kind of block (model identity, salt, ...)."""
    return _digest(*(str(p).encode() for p in parts))


def token_bytes(tokens: Sequence[int]) -> bytes:
    return array("q", tokens).tobytes()


def chain(root: bytes, blocks: Iterable[bytes]) -> list[bytes]:
    """One key per block: block j's key digests the key before it and block j's content."""
    keys, key = [], root
    for content in blocks:
        key = _digest(key, content)
        keys.append(key)
    return keys


def token_keys(root: bytes, tokens: Sequence[int], block: int = BLOCK_TOKENS) -> list[bytes]:
    """Keys of the whole blocks of ``tokens`` (an input per token: a target, a draft LM)."""
    return chain(root, (token_bytes(tokens[j:j + block]) for j in range(0, len(tokens) - block + 1, block)))


def usable(inputs: int, block: int = BLOCK_TOKENS) -> int:
    """Blocks a prefill of ``inputs`` inputs may load: its run keeps at least one input and starts on a boundary."""
    return max(inputs - 1, 0) // block


def chunks(start: int, end: int, block: int = BLOCK_TOKENS) -> list[tuple[int, int]]:
    """[start, end) cut at block boundaries (``start`` on one)."""
    return [(a, min(end, a + block)) for a in range(start, end, block)]


@dataclass
class CacheStats:
    """Counters since start (the services turn them into Prometheus series)."""

    lookups: int = 0            # prefills that looked their prompt up
    hits: int = 0               # of those, the ones that found at least one block
    hit_tokens: int = 0         # tokens of the found prefixes
    saved_tokens: int = 0       # prefill inputs loaded instead of computed
    inserted_tokens: int = 0
    evictions: int = 0          # blocks evicted (budget, or room for sessions)
    evicted_tokens: int = 0

    def snapshot(self) -> CacheStats:
        return CacheStats(**vars(self))


@dataclass
class _Block:
    payload: object
    nbytes: int


@dataclass
class PrefixCache:
    """LRU blocks under ``max_tokens`` (0: off) of ``block`` inputs each (None:
    ``block_tokens(exact)``); ``exact``: see ``spans``. Thread-safe."""

    max_tokens: int
    block: int | None = None
    exact: bool = False         # prefills in block-aligned chunks: a hit gives a miss's bits (module doc)
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self):
        if self.block is None:
            self.block = block_tokens(self.exact)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"prefix cache tokens must be an integer >= 0, got {self.max_tokens!r}")
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()     # oldest first
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def on(self) -> bool:
        return self.max_tokens >= self.block

    @property
    def tokens(self) -> int:
        return len(self._blocks) * self.block

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._blocks)

    def spans(self, start: int, end: int) -> list[tuple[int, int]]:
        """The forwards a prefill runs [start, end) in (``start`` on a block boundary): block-aligned chunks
        when ``exact``, else one."""
        if self.exact:
            return chunks(start, end, self.block)
        return [(start, end)] if start < end else []

    def match(self, keys: Sequence[bytes], limit: int | None = None) -> list:
        """The payloads of the longest run of ``keys`` from the first that is
        cached, at most ``limit`` of them (``usable``); counts one lookup."""
        with self._lock:
            found = []
            for key in keys:
                block = self._blocks.get(key)
                if block is None:
                    break
                found.append(key)
            self.stats.lookups += 1
            if found:
                self.stats.hits += 1
                self.stats.hit_tokens += len(found) * self.block
            used = found if limit is None else found[:limit]
            self.stats.saved_tokens += len(used) * self.block
            for key in reversed(found):                   # the first block ends freshest
                self._blocks.move_to_end(key)
            return [self._blocks[key].payload for key in used]

    def missing(self, keys: Sequence[bytes]) -> list[int]:
        """Indices of ``keys`` not cached."""
        with self._lock:
            return [j for j, key in enumerate(keys) if key not in self._blocks]

    def insert(self, keys: Sequence[bytes], payload: Callable[[int], tuple[object, int]]) -> None:
        """Add every block of ``keys`` not cached, ``payload(j)`` -> (block j's
        payload, its bytes); blocks past what the budget can ever hold are not
        added; the least recently used go to make room."""
        if not self.on:
            return
        room = self.max_tokens // self.block
        for j in self.missing(keys[:room]):
            value, nbytes = payload(j)
            with self._lock:
                if keys[j] in self._blocks:
                    continue
                self._blocks[keys[j]] = _Block(value, nbytes)
                self._bytes += nbytes
                self.stats.inserted_tokens += self.block
                while len(self._blocks) > room:
                    self._pop_oldest()
        with self._lock:
            for key in reversed(keys[:room]):
                if key in self._blocks:
                    self._blocks.move_to_end(key)

    def evict_bytes(self, nbytes: int) -> int:
        """Evict least recently used blocks until ``nbytes`` are freed or none is
        left (room for a session); bytes freed."""
        freed = 0
        with self._lock:
            while freed < nbytes and self._blocks:
                freed += self._pop_oldest()
        return freed

    def clear(self) -> None:
        with self._lock:
            while self._blocks:
                self._pop_oldest()

    def reset(self) -> None:
        """No block and every count back to zero (a bench after its warm-up)."""
        self.clear()
        self.stats = CacheStats()

    def _pop_oldest(self) -> int:
        _, block = self._blocks.popitem(last=False)
        self._bytes -= block.nbytes
        self.stats.evictions += 1
        self.stats.evicted_tokens += self.block
        return block.nbytes
