"""In-process speculative generation: drafter and verifier engines in one process.

The loop (DESIGN.md §1) per request: prefill the verifier (first token and
features), prefill the drafter, then draft -> verify (which commits the
accepted path) -> commit to the drafter, until a stop condition. With no
drafter every tree is the root alone: plain autoregressive decoding through
the very same verifier code, the baseline every method is compared with.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from specdec.decoding import Decoding, StopCriteria
from specdec.models import ModelSpec, demo_path, load_tokenizer
from specdec.params import SamplingParams
from specdec.params import TreeParams
from specdec.tree import tree_from_lists


@dataclass(frozen=True)
class DrafterChoice:
    kind: str                     # "none" | "eagle" | "draft-lm" | "ngram"
    path: str | None = None


@dataclass
class LocalStack:
    verifier: object              # verifier.engine.VerifierEngine
    drafter: object | None        # drafter.base.Drafter
    tokenizer: object


def build_local(target: ModelSpec, choice: DrafterChoice, tokenizer_dir: str | None = None) -> LocalStack:
    from verifier.engine import TargetModel, VerifierEngine

    tok = load_tokenizer(tokenizer_dir or target.path)
    verifier = VerifierEngine(TargetModel(target))
    drafter = None
    if choice.kind == "eagle":
        from drafter.eagle import EagleDrafter

        drafter = EagleDrafter(choice.path, target.path, device=target.device)
    elif choice.kind == "draft-lm":
        from drafter.draft_lm import DraftLmDrafter

        drafter = DraftLmDrafter(replace(target, path=choice.path))
    elif choice.kind == "ngram":
        from drafter.ngram import NgramDrafter

        drafter = NgramDrafter(verifier.target.vocab_size)
    elif choice.kind != "none":
        raise ValueError(f"unknown drafter {choice.kind!r}")
    return LocalStack(verifier, drafter, tok)


def cycle_config(cfg: TreeParams, remaining: int) -> TreeParams | None:
    """Never draft deeper than the tokens still wanted; None: root-only."""
    if remaining <= 1:
        return None
    return cfg if cfg.depth < remaining else replace(cfg, depth=remaining - 1)


def generate(verifier, drafter, prompt: list[int], params: SamplingParams, stop: StopCriteria,
             tree_cfg: TreeParams | None, min_tau: float = 0.0, lookahead: int = 0,
             logprobs: int | None = None) -> Decoding:
    """Run one request to completion; ``drafter=None`` or ``tree_cfg=None`` is vanilla.
    ``min_tau``: pause drafting while recent cycles commit fewer tokens (``SpeculationGate``).
    ``lookahead``: trees drafted one round ahead per cycle (``Drafter.draft_ahead``);
    here they are drafted before the verify, where the services draft them during it,
    so both loops use the same trees. ``logprobs``: each token's raw logprob
    with that many top alternatives, in ``Decoding.logprobs``."""
    sid = uuid.uuid4().hex
    dec = Decoding(stop, min_tau)
    times = dec.stats.time_s
    use_drafter = drafter is not None and tree_cfg is not None
    pending: list[tuple[list[int], object]] = []      # committed, not yet given to the drafter
    ahead: dict[tuple[int, ...], object] = {}          # outcome tokens -> tree drafted for it
    try:
        t = time.perf_counter()
        first = verifier.prefill(sid, prompt, params, stop.max_new_tokens, logprobs=logprobs)
        times["prefill"] += time.perf_counter() - t
        dec.add([first.token], first.logprobs)
        if use_drafter and not dec.done:
            t = time.perf_counter()
            drafter.prefill(sid, prompt + [first.token], first.features if drafter.needs_features else None,
                            sampling=params)
            times["commit"] += time.perf_counter() - t
        last: tuple[int, ...] = ()
        while not dec.done:
            t = time.perf_counter()
            drafting = use_drafter and dec.gate.speculate()
            remaining = stop.max_new_tokens - len(dec.tokens)
            cfg = cycle_config(tree_cfg, remaining) if drafting else None
            tree = ahead.get(last) if cfg is not None else None
            dec.stats.ahead_hits += tree is not None
            if tree is None and cfg is not None:
                if pending:
                    drafter.commit(sid, *_joined(pending, drafter.needs_features))
                    pending = []
                tree = drafter.draft(sid, cfg, ahead=True) if lookahead > 0 else drafter.draft(sid, cfg)
            ahead = {}
            if tree is not None and lookahead > 0:
                tokens, feats = _joined(pending, drafter.needs_features)
                pending = []
                ahead = {tuple(c): tr for c, tr in drafter.draft_ahead(sid, tokens, feats, cfg, lookahead,
                                                                        remaining)}
            if tree is None:
                tree = tree_from_lists([dec.tokens[-1]], [-1])
            t2 = time.perf_counter()
            result = verifier.verify(sid, tree)
            t3 = time.perf_counter()
            times["draft"] += t2 - t
            times["verify"] += t3 - t2
            dec.stats.record_cycle(tree.size, len(result.accepted))
            dec.gate.record(tree.size > 1, len(result.tokens))
            dec.add(result.tokens, result.logprobs)
            last = tuple(result.tokens)
            if use_drafter and not dec.done:
                pending.append((list(result.tokens), result.features if drafter.needs_features else None))
    finally:
        verifier.release(sid)
        if drafter is not None:
            drafter.release(sid)
    dec.finish()
    return dec


def _joined(pending: list[tuple[list[int], object]], with_features: bool) -> tuple[list[int], object]:
    """Several cycles' commits as one (tokens, features)."""
    import torch

    tokens = [t for toks, _ in pending for t in toks]
    feats = torch.cat([f for _, f in pending]) if with_features and pending else None
    return tokens, feats


def default_paths() -> dict[str, Path]:
    return {name: demo_path(name) for name in ("target", "eagle", "draft-lm", "tokenizer")}
