"""In-process speculative generation: drafter and verifier engines in one process.

The loop is ``specdec.request.speculative`` (the one the orchestrator runs over
gRPC); here it runs on the engines themselves, through ``LocalVerifier`` and
``LocalDrafter``, which convert at their edge. With no drafter every tree is
the root alone: plain autoregressive decoding through the very same verifier
code, the baseline every method is compared with.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import llguidance.hf
import torch

from specdec.model.loading import ModelSpec, demo_path, load_tokenizer
from specdec.request.decoding import Decoding, StopCriteria
from specdec.request.lookahead import LookaheadParams
from specdec.request.pace import Paces, knobs_key
from specdec.request.params import LOOKAHEAD, SamplingParams, TreeParams
from specdec.request.speculative import Committed, Draft, Request, SelfDraft, speculative_generate
from specdec.tree.build import tree_from_lists
from specdec.tree.placed import host_tree
from specdec.tree.sizing import restore


@dataclass(frozen=True)
class DrafterChoice:
    kind: str                     # "none" | "eagle" | "medusa" | "hydra" | "draft-lm" | "ngram"
    path: str | None = None
    static_shape: tuple | None = None   # medusa, hydra: the static tree's rank paths (None: mc_sim_7b_63)


@dataclass
class LocalStack:
    verifier: object              # verifier.engine.VerifierEngine
    drafter: object | None        # drafter.base.Drafter
    tokenizer: object


def build_local(target: ModelSpec, choice: DrafterChoice, tokenizer_dir: str | None = None,
                tree_sizing: str = "fixed", prefix_cache_tokens: int = 0, prefix_cache_exact: bool = False,
                lookahead: LookaheadParams = LookaheadParams()) -> LocalStack:
    """``prefix_cache_tokens``, ``prefix_cache_exact``: both engines' prefix caches (0: off);
    ``lookahead``: W, N, G of method "lookahead" (the verifier's; no drafter: ``choice`` "none")."""
    from verifier.engine import TargetModel, VerifierEngine

    tok = load_tokenizer(tokenizer_dir or target.path)
    grammar_tok = llguidance.hf.from_tokenizer(tok)       # structured output (specdec.tree.grammar)
    verifier = VerifierEngine(TargetModel(target), tree_sizing=tree_sizing, grammar_tokenizer=grammar_tok,
                              prefix_cache_tokens=prefix_cache_tokens, prefix_cache_exact=prefix_cache_exact,
                              lookahead=lookahead)
    drafter = None
    if choice.kind == "eagle":             # EAGLE-1/2 or EAGLE-3, told apart by the head's config
        from drafter.eagle.eagle3 import load_eagle_drafter

        drafter = load_eagle_drafter(choice.path, target.path, device=target.device, compile=target.compile,
                                     weights=target.weights)
        if getattr(drafter, "feature_layers", ()):      # EAGLE-3: its verifies return feature layers
            verifier.target.compile_feature_layers()
    elif choice.kind == "medusa":
        from drafter.medusa import load_medusa_drafter

        drafter = load_medusa_drafter(choice.path, target.path, device=target.device,
                                      static_shape=choice.static_shape)
    elif choice.kind == "hydra":
        from drafter.hydra import load_hydra_drafter

        drafter = load_hydra_drafter(choice.path, target.path, device=target.device,
                                     static_shape=choice.static_shape)
    elif choice.kind == "draft-lm":
        from drafter.draft_lm import DraftLmDrafter

        drafter = DraftLmDrafter(replace(target, path=choice.path))
    elif choice.kind == "ngram":
        from drafter.ngram import NgramDrafter

        drafter = NgramDrafter(verifier.target.vocab_size)
    elif choice.kind != "none":
        raise ValueError(f"unknown drafter {choice.kind!r}")
    if drafter is not None:
        drafter.grammar_tokenizer = grammar_tok
        drafter.use_prefix_cache(prefix_cache_tokens, prefix_cache_exact)
    return LocalStack(verifier, drafter, tok)


class LocalVerifier:
    """``speculative.Verifier`` over an in-process engine (``verifier.engine.VerifierEngine``)."""

    network_s = 0.0

    def __init__(self, engine, sid: str, logprobs: int | None = None, feature_layers: tuple[int, ...] = (),
                 prompt_logprobs: int | None = None, cache_salt: str = ""):
        self.engine = engine
        self.sid = sid
        self.cache_salt = cache_salt               # prefix-cache isolation (``VerifierEngine.prefill``)
        self.logprobs = logprobs                   # top alternatives per token's logprob; None: no logprobs
        self.prompt_logprobs = prompt_logprobs     # the same for the prompt's tokens (the prefill's)
        self.feature_layers = feature_layers       # the drafter's (``VerifierEngine.prefill``)
        self.root: int | None = None               # the last committed token

    @property
    def sessions(self) -> int:
        return len(self.engine.sessions)

    async def prefill(self, prompt: list[int], sampling: SamplingParams, max_new_tokens: int,
                      features: bool) -> Committed:
        first = self.engine.prefill(self.sid, prompt, sampling, max_new_tokens, logprobs=self.logprobs,
                                    feature_layers=self.feature_layers if features else (),
                                    prompt_logprobs=self.prompt_logprobs, cache_salt=self.cache_salt)
        self.root = first.token
        return Committed([first.token], [], first.features, first.logprobs, prompt_logprobs=first.prompt_logprobs)

    async def verify(self, draft: Draft | None, features: bool) -> Committed:
        if draft is not None and isinstance(draft.tree, SelfDraft):      # lookahead decoding: the engine drafts
            result = self.engine.verify_lookahead(self.sid, draft.tree.depth)
            self.root = result.tokens[-1]
            return Committed(result.tokens, result.accepted, result.features, result.logprobs, result.nodes)
        tree = draft.tree if draft is not None else tree_from_lists([self.root], [-1])
        sizer = getattr(self.engine, "sizer", None)        # the engine's tree sizing (specdec.tree.sizing)
        if sizer is None:                                   # (a tree left on the device is read with the verdict)
            result = self.engine.verify(self.sid, tree)
            accepted = result.accepted
        else:
            tree, keep = sizer.cut(self.sid, host_tree(tree), self.engine.sessions.get(self.sid).params.greedy)
            start = time.perf_counter()
            result = self.engine.verify(self.sid, tree)
            sizer.verified(self.sid, tree.size, time.perf_counter() - start, len(result.tokens))
            accepted = restore(result.accepted, keep)
        self.root = result.tokens[-1]
        return Committed(result.tokens, accepted, result.features, result.logprobs, tree.size,
                         token_ids=result.token_ids)

    async def release(self) -> None:
        self.engine.release(self.sid)


class LocalDrafter:
    """``speculative.Drafter`` over an in-process engine (``drafter.base.Drafter``);
    the commits a draft carries are joined into one (tokens, features [n, H])."""

    network_s = 0.0

    def __init__(self, engine, sid: str, cache_salt: str = ""):
        self.engine = engine
        self.sid = sid
        self.cache_salt = cache_salt               # prefix-cache isolation (``Drafter.prefill``)

    @property
    def needs_features(self) -> bool:
        return self.engine.needs_features

    @property
    def drafts_ahead(self) -> bool:
        return self.engine.drafts_ahead

    async def prefill(self, tokens: list[int], features, sampling: SamplingParams) -> None:
        self.engine.prefill(self.sid, tokens, features if self.needs_features else None, sampling=sampling,
                            cache_salt=self.cache_salt)

    async def draft(self, commits: list[Committed], tree: TreeParams, ahead: bool) -> Draft:
        if commits:
            ids = self.joined_ids(commits)
            if ids is not None and getattr(self.engine, "takes_token_ids", False):  # ``drafter.base.Drafter``
                self.engine.commit(self.sid, *self.joined(commits), token_ids=ids)
            else:
                self.engine.commit(self.sid, *self.joined(commits))
        # a tree drafted on the device stays there, unread, for the verifier here (``specdec.tree.placed``)
        if ahead:
            drafted = self.engine.draft(self.sid, tree, ahead=True)
        elif getattr(self.engine, "defers", False):          # ``drafter.base.Drafter``: it may leave it unread
            drafted = self.engine.draft(self.sid, tree, deferred=True)
        else:
            drafted = self.engine.draft(self.sid, tree)
        return Draft(drafted, drafted.size)

    async def draft_ahead(self, commits: list[Committed], tree: TreeParams, count: int,
                          tokens_left: int) -> dict[tuple[int, ...], Draft]:
        tokens, features = self.joined(commits)
        trees = self.engine.draft_ahead(self.sid, tokens, features, tree, count, tokens_left)
        return {tuple(commit): Draft(drafted, drafted.size) for commit, drafted in trees}

    async def release(self) -> None:
        self.engine.release(self.sid)

    def joined(self, commits: list[Committed]) -> tuple[list[int], torch.Tensor | None]:
        """Several cycles' commits as one: tokens, features [n, H] (None unless needed; one
        commit's as they are)."""
        tokens = [t for c in commits for t in c.tokens]
        if not self.needs_features or not commits:
            return tokens, None
        return tokens, commits[0].features if len(commits) == 1 else torch.cat([c.features for c in commits])

    @staticmethod
    def joined_ids(commits: list[Committed]) -> torch.Tensor | None:
        """The commits' tokens on the verifier's device where one commit has them there (else None)."""
        return commits[0].token_ids if len(commits) == 1 else None


PACES = Paces()     # one per pair of in-process engines and tree knobs


def generate(verifier, drafter, prompt: list[int], params: SamplingParams, stop: StopCriteria,
             tree_cfg: TreeParams | None, min_tau: float = 0.0, lookahead: int = 0,
             logprobs: int | None = None, prompt_logprobs: int | None = None, cache_salt: str = "",
             min_tau_prior: bool = False) -> Decoding:
    """Run one request to completion through the speculative loop
    (``specdec.request.speculative``) on in-process engines; ``drafter=None`` or
    ``tree_cfg=None`` is vanilla; ``tree_cfg.method`` "lookahead" is
    lookahead decoding on the verifier (``drafter`` unused). ``min_tau``:
    pause drafting while recent cycles commit fewer tokens (``SpeculationGate``). ``lookahead``: trees
    drafted one round ahead per cycle (``Drafter.draft_ahead``, greedy
    sessions); in-process they are drafted before the verify, where the
    services draft them during it, so both use the same trees. ``logprobs``:
    each token's raw logprob with that many top alternatives, in
    ``Decoding.logprobs`` (None: none); ``prompt_logprobs``: the prompt's, in
    ``Decoding.prompt_logprobs``. ``stop.max_new_tokens`` 0: the prompt only.
    ``cache_salt``: the engines' prefix caches share blocks within one salt only. ``min_tau_prior``:
    ``min_tau`` is ``--min-tau auto``'s default, replaced by the measured break-even (``SpeculationGate``)."""
    sid = uuid.uuid4().hex
    self_drafted = tree_cfg is not None and tree_cfg.method == LOOKAHEAD     # the verifier drafts (lookahead)
    request = Request(prompt, params, tree_cfg if drafter is not None or self_drafted else None, lookahead)
    local_drafter = LocalDrafter(drafter, sid, cache_salt) if drafter is not None and not self_drafted else None

    # greedy sessions on the same engines and tree knobs share what their cycles cost (specdec.request.pace)
    engines = (verifier, drafter) if local_drafter is not None else (verifier,)
    pace = PACES.of_objects(engines, *knobs_key(tree_cfg, lookahead)) if request.tree is not None else None

    async def run() -> Decoding:
        layers = tuple(getattr(drafter, "feature_layers", ()))
        return await speculative_generate(LocalVerifier(verifier, sid, logprobs, layers, prompt_logprobs, cache_salt),
                                          local_drafter, request, Decoding(stop, min_tau, min_tau_prior),
                                          pace=pace)

    # the engines are synchronous: the loop never waits on I/O, asyncio only sequences it
    return asyncio.run(run())


def default_paths() -> dict[str, Path]:
    return {name: demo_path(name) for name in ("target", "eagle", "medusa", "hydra", "draft-lm", "tokenizer")}
