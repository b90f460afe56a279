"""Batched compiled verification: several sessions' rows in one compiled
forward (``specdec.compile.forwards``, ``verifier.batch``).

A batch is one stacked cache [layers, 2, B, heads, C, d]: row b holds its
session's prefix, zeros up to the longest prefix P, then every row's tokens at
slots [P, P + width) (``CompiledForward.batch_cache``: one copy of every
prefix, as the eager batch does). Its graphs are ahead-of-time packages whose
batch dimension is free (2 to ``MAX_BATCH`` rows): one per width and packaged
capacity, not one per batch size. Only the widths of a batch of root-only
cycles and of default trees (``READY_WIDTHS``) are built, at start-up, and
opened while the verifier is idle; a batch they do not serve (another width,
a longer prefix) runs row by row on the one-session graphs, which on the
demo target beat one eager batched forward at every batch size up to 8.
"""

from __future__ import annotations

import logging
import time

import torch

from specdec.compile.eager import eager_run
from specdec.compile.forwards import READY_WIDTHS, CompiledForward

log = logging.getLogger(__name__)


@torch.inference_mode()
def check_batched(compiled: CompiledForward, layers: tuple[int, ...] = ()) -> str | None:
    """Why the batched graphs cannot serve this model (None: they can): two
    rows of unequal prefixes, one token each, must give each row's eager logits
    (and the streams entering ``layers``)."""
    lm = compiled.lm
    vocab = int(lm.config.get_text_config(decoder=True).vocab_size)
    seq = torch.randint(0, vocab, (8,), generator=torch.Generator().manual_seed(1))
    caches, lengths, want = [], (3, 6), []
    for length in lengths:
        cache = compiled.new_cache(16)
        lm.hidden(cache, seq[None, :length], torch.arange(length)[None], None)
        caches.append(cache)
        eager = lm.new_cache()
        lm.hidden(eager, seq[None, :length], torch.arange(length)[None], None)
        want.append(eager_run(lm, eager, seq[None, length:length + 1], torch.tensor([[length]]), None, layers))
    batch = compiled.batch_cache(caches, list(lengths), 1, layers)
    prefix = max(lengths)
    allowed = torch.zeros(2, 1, prefix + 1, dtype=torch.bool)
    for b, length in enumerate(lengths):
        allowed[b, 0, :length] = allowed[b, 0, prefix] = True
    positions = torch.tensor([[length] for length in lengths])
    k_pos = torch.cat([torch.arange(prefix).expand(2, prefix), positions], dim=1)
    got = compiled.run(batch, seq[list(lengths)][:, None], positions, lm.masks(allowed, positions, k_pos), layers)
    if got is None:
        return "a batch of two rows does not take the batched graphs"
    for b in range(2):
        for name, i in (("streams", 1), ("logits", 2)):
            if want[b][i] is not None:
                err = float((got[i][b] - want[b][i][0]).abs().max() / (1.0 + want[b][i].abs().max()))
                if not err <= (1e-4 if lm.dtype == torch.float32 else 5e-2):
                    return f"batched {name} differ from eager ones (relative error {err:.2g})"
    return None


def compile_batches(compiled: CompiledForward) -> bool:
    """Add the batched graphs (``CompiledForward.batch_graphs``: batched
    verification), checked against eager rows and built at ``READY_WIDTHS``
    (a batch of root-only cycles, of default trees) and every packaged
    capacity, opened while idle (``open_next``); False, with one log line,
    where that fails (batches then run row by row)."""
    kind = getattr(compiled.lm.config, "model_type", "?")
    if compiled.packages is None:
        log.info("batched compiled forwards off for model type %r: batched graphs are ahead-of-time packages, "
                 "which the compiled forwards on this device do not use; batches run row by row", kind)
        return False
    t = time.perf_counter()
    try:
        compiled.batch_graphs()
        for captures in compiled.batched:          # built first: the check runs on the packages
            compiled.warm(READY_WIDTHS, captures=captures, batched=True, ready=())
        reason = next(filter(None, (check_batched(compiled, compiled.some_layers() if captures else ())
                                    for captures in compiled.batched)), None)
        compiled.due = [(w, c, captures, batched) for w, c, captures, batched in compiled.due   # the check opened some
                        if not batched or (w, c) not in compiled.batched[captures].graphs]
    except Exception as exc:  # noqa: BLE001 - any failure means: batches run row by row
        reason = f"compilation failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    if reason is not None:
        compiled.batched = {}
        compiled.due = [graph for graph in compiled.due if not graph[3]]
        log.warning("batched compiled forwards off for model type %r: %s; batches run row by row", kind, reason)
        return False
    log.info("batched compiled forwards on for model type %r (%.1f s; widths %s)", kind, time.perf_counter() - t,
             ",".join(map(str, READY_WIDTHS)))
    return True
