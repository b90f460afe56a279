"""``specdec bench`` in-process and through the services: load the models once,
build every method, measure them interleaved and return the JSON record.

``Models`` holds what all methods share (one target model object serves
vanilla, the speculative methods and the HF peers; drafters load on first
use); ``run_bench`` is the whole run. The measurement itself is
``specdec.bench.runner``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import replace

import torch

from specdec.bench.calibration import TreeRecorder, calibration_bins
from specdec.bench.llamacpp_peer import identical_fraction, llamacpp_methods
from specdec.bench.peers import PROMPT_LOOKUP_TOKENS, HfPeer
from specdec.bench.runner import (CALIBRATED, LLAMACPP_METHODS, OPENAI_METHOD, PEER_METHODS, SPECULATIVE, BenchConfig,
                                  SELF_DRAFTED, LocalMethod, Method, PinnedMethod, Prompt, device_name, measure,
                                  method_tree,
                                  other_sizing, stderr_progress, summarize, with_references)
from specdec.bench.services import grpc_methods
from specdec.compile import aot
from specdec.model.loading import AHEAD_ENV, ModelSpec, load_causal_lm, load_tokenizer
from specdec.model.prompts import chat_text, prompt_ids
from specdec.procs import pinned_cores
from specdec.request.decoding import StopCriteria
from specdec.request.params import TreeParams
from drafter.compiled import whole_draft
from drafter.eagle.eagle3 import Eagle3Drafter
from verifier.engine import TargetModel, VerifierEngine


class Models:
    """Everything loaded once and shared by all methods: one target model object
    serves vanilla, every speculative method and the HF peers."""

    def __init__(self, cfg: BenchConfig):
        self.cfg = cfg
        self.spec = ModelSpec(path=cfg.target, dtype=cfg.dtype, device=cfg.device, compile=cfg.compile,
                              weights=cfg.weights)
        self.tokenizer = load_tokenizer(cfg.target)
        self.target = TargetModel(self.spec)
        self.verifier = VerifierEngine(self.target, tree_sizing=cfg.tree_sizing,
                                       prefix_cache_tokens=cfg.prefix_cache_tokens,
                                       prefix_cache_exact=cfg.prefix_cache_exact, lookahead=cfg.lookahead_wng)
        eos = self.tokenizer.eos_token_id
        self.eos_ids = frozenset() if eos is None else frozenset([int(eos)])
        self._drafters: dict[str, object] = {}
        self._assistant = None

    def encode(self, texts: Sequence[str | list[dict]]) -> list[Prompt]:
        """Prompt texts, or chats rendered with the target's chat template, as token ids."""
        prompts = []
        limit = self.target.max_positions
        for i, text in enumerate(texts):
            ids = prompt_ids(self.tokenizer, text) if text else []
            if not isinstance(text, str):
                text = chat_text(self.tokenizer, text)
            if not ids:
                raise ValueError(f"prompt {i + 1} is empty")
            # + depth: a draft tree reaches that far past the last committed token
            if len(ids) + self.cfg.max_new_tokens + self.cfg.tree.depth > limit:
                raise ValueError(f"prompt {i + 1} ({len(ids)} tokens) + max-new-tokens "
                                 f"({self.cfg.max_new_tokens}) + tree depth exceeds the target's "
                                 f"context of {limit} tokens")
            prompts.append(Prompt(text, ids))
        return prompts

    def assistant(self):
        if self._assistant is None:
            self._assistant = load_causal_lm(replace(self.spec, path=self._need(self.cfg.draft_lm, "draft LM")))
        return self._assistant

    def loaded_drafters(self) -> list:
        return list(self._drafters.values())

    def drafter(self, kind: str):
        """The drafter of ``kind``, loaded on first use; None for lookahead decoding (the verifier drafts)."""
        if kind in SELF_DRAFTED:
            return None
        if kind not in self._drafters:
            if kind == "eagle":
                from drafter.eagle.eagle2 import EagleDrafter

                self._drafters[kind] = EagleDrafter(self._need(self.cfg.eagle, "EAGLE head"), self.cfg.target,
                                                    device=self.cfg.device, compile=self.cfg.compile)
            elif kind == "eagle3":
                self._drafters[kind] = Eagle3Drafter(self._need(self.cfg.eagle3, "EAGLE-3 head"), self.cfg.target,
                                                     device=self.cfg.device, compile=self.cfg.compile,
                                                     weights=self.cfg.weights)
                self.target.compile_feature_layers()       # its verifies return feature layers
            elif kind == "medusa":
                from drafter.medusa import load_medusa_drafter

                self._drafters[kind] = load_medusa_drafter(self._need(self.cfg.medusa, "Medusa heads"),
                                                           self.cfg.target, device=self.cfg.device)
            elif kind == "hydra":
                from drafter.hydra import load_hydra_drafter

                self._drafters[kind] = load_hydra_drafter(self._need(self.cfg.hydra, "Hydra heads"),
                                                          self.cfg.target, device=self.cfg.device)
            elif kind == "ngram":
                from drafter.ngram import NgramDrafter

                self._drafters[kind] = NgramDrafter(self.target.vocab_size)
            elif kind == "draft-lm":
                from drafter.draft_lm import DraftLmDrafter

                self._drafters[kind] = DraftLmDrafter(model=self.assistant(), compile=self.cfg.compile)
            else:
                raise ValueError(f"unknown drafter kind {kind!r}")
            self._drafters[kind].use_prefix_cache(self.cfg.prefix_cache_tokens, self.cfg.prefix_cache_exact)
        return self._drafters[kind]

    @staticmethod
    def _need(path: str | None, what: str) -> str:
        if path is None:
            raise ValueError(f"no {what} directory given")
        return path

    def stop(self) -> StopCriteria:
        return StopCriteria(max_new_tokens=self.cfg.max_new_tokens, eos_ids=self.eos_ids)

    def local(self, name: str, tree: TreeParams | None = None, verifier=None) -> LocalMethod:
        """An in-process method; ``tree`` overrides the knobs of the config."""
        verifier = verifier if verifier is not None else self.verifier
        if name == "vanilla":
            return LocalMethod(verifier, None, None, self.cfg.params, self.stop())
        kind = SPECULATIVE[name][0]
        return LocalMethod(verifier, self.drafter(kind), method_tree(name, tree or self.cfg.tree),
                           self.cfg.params, self.stop(), self.cfg.gate(kind), self.cfg.min_tau is None)

    def peer(self, name: str):
        return HfPeer(name, self.target.model, self.cfg.max_new_tokens, self.cfg.temperature, self.eos_ids,
                      assistant=self.assistant() if name == "hf-assisted" else None)


def run_bench(cfg: BenchConfig, texts: Sequence[str], progress: Callable[[str], None] | None = None) -> dict:
    """Load the models, run every method (and its gRPC twin with ``cfg.grpc``)
    on the prompts, interleaved; return the JSON record of ``specdec bench``."""
    names = with_references(cfg.methods)
    models = Models(cfg)
    prompts = models.encode(texts)
    recorder = TreeRecorder(models.verifier)
    methods: dict[str, Method] = {}
    llama, llama_notes = llamacpp_methods(names, cfg.target, models.target.model, cfg.max_new_tokens,
                                          cfg.temperature, models.eos_ids, models.target.max_positions,
                                          torch.get_num_threads())
    for note in llama_notes:
        (progress or stderr_progress("bench"))(note)
    for name in names:
        if name in LLAMACPP_METHODS:
            continue                          # last in the canonical order: added below, where available
        if name in PEER_METHODS:
            methods[name] = models.peer(name)
        else:
            methods[name] = models.local(name, verifier=recorder if name == CALIBRATED else None)
    engines = [models.verifier]
    if cfg.compare_tree_sizing:            # the same target under a verifier that sizes trees the other way
        other = other_sizing(cfg.tree_sizing)
        twin = VerifierEngine(models.target, tree_sizing=other, lookahead=cfg.lookahead_wng)
        engines.append(twin)
        for name in [n for n in names if n in SPECULATIVE]:
            methods[f"{name}@{other}"] = models.local(name, verifier=twin)
    methods.update(llama)
    if cfg.pin:             # in-process: the target's one core (the services' verifier core)
        core = frozenset([pinned_cores()[0]])
        methods = {name: PinnedMethod(method, core) for name, method in methods.items()}
    if models.target.compiled is not None:     # steady state: no graph left to build or open while timed
        models.target.compile_trees(cfg.tree.total_tokens)
        models.target.compiled.open_all()
    for drafter in models.loaded_drafters():   # the run's budget drafted whole (drafter.compiled.whole_draft)
        whole_draft.use_budget(drafter, cfg.tree)
    with ExitStack() as stack:
        if cfg.grpc:
            methods.update(stack.enter_context(grpc_methods(cfg, names, progress)))
        if cfg.openai_url:
            from specdec.bench.openai_peer import OpenAIPeer      # httpx: the optional `bench` extra

            methods[OPENAI_METHOD] = peer = OpenAIPeer(
                cfg.openai_url, cfg.max_new_tokens, cfg.temperature, cfg.openai_model, cfg.openai_key,
                encode=lambda text: models.tokenizer(text, add_special_tokens=False)["input_ids"])
            stack.callback(peer.close)
        built = aot.BUILT[0]
        totals = measure(methods, prompts, cfg.repeats, cfg.seed, on_warm=recorder.clear, progress=progress)
    points = recorder.points()
    timed_builds = [built_while_timed(aot.BUILT[0] - built)] if aot.BUILT[0] > built else []
    for note in timed_builds:
        (progress or stderr_progress("bench"))(note)
    sizer = next((engine.sizer for engine in engines if engine.sizer is not None), None)
    return {
        "device": device_name(cfg.device),
        "target": cfg.target,
        "temperature": float(cfg.temperature),
        "prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens,
        "methods": summarize(totals, greedy=cfg.params.greedy),
        "tree": {"total_tokens": cfg.tree.total_tokens, "depth": cfg.tree.depth, "expand_k": cfg.tree.expand_k,
                 "min_tau": cfg.min_tau, "lookahead": list(cfg.lookahead) if cfg.grpc else []},
        "pinned": cfg.pin,
        "compile": cfg.compile,
        "weights": cfg.weights,
        "tree_sizing": {"mode": cfg.tree_sizing, "compared": cfg.compare_tree_sizing,
                        **({} if sizer is None else sizer.snapshot())},
        "models": {"target": cfg.target, "eagle": cfg.eagle, "draft_lm": cfg.draft_lm, "eagle3": cfg.eagle3,
                   "medusa": cfg.medusa, "hydra": cfg.hydra},
        "lookahead_wng": str(cfg.lookahead_wng),
        "repeats": cfg.repeats,
        "openai_url": cfg.openai_url,
        "generated_tokens": {name: tot.tokens for name, tot in totals.items()},
        "peers": {"hf-assisted": "assistant_model = draft LM, HF default assistant-token schedule",
                  "hf-prompt-lookup": f"prompt_lookup_num_tokens = {PROMPT_LOOKUP_TOKENS}"},
        "notes": ["tau counts the bonus token (tokens committed per draft/verify cycle; vanilla = 1)",
                  "accepted_per_position[j]: fraction of cycles accepting >= j+1 draft tokens",
                  "methods interleaved per prompt, order rotated per prompt; one warm-up per method excluded",
                  "stop at EOS or max_new_tokens; tokens/s = generated tokens / generate wall time incl. prefill",
                  *timed_builds],
        "llamacpp": {"notes": llama_notes, "identical_to_vanilla": {
            n: identical_fraction(totals[n].outputs(), totals["vanilla"].outputs()) for n in llama}
            if cfg.params.greedy else None},
        "prefix_cache": prefix_record(cfg, models),
        "calibration": ({"method": CALIBRATED, "evaluated_nodes": len(points), "bins": calibration_bins(points)}
                        if CALIBRATED in names else None),
    }


def built_while_timed(count: int) -> str:
    """The warning for compiled graphs this process built inside the timed runs."""
    return (f"WARNING: {count} compiled graph{'s' if count > 1 else ''} built inside the timed runs (a shape "
            f"first needed there: with {AHEAD_ENV}=ready graphs are built on demand); the build time is in "
            f"these figures: rerun (the packages are on disk now) or leave {AHEAD_ENV} at all")


def prefix_record(cfg: BenchConfig, models: Models) -> dict | None:
    """The in-process engines' prefix caches: lookups, hit rate, saved prefill tokens (None: off)."""
    if not cfg.prefix_cache_tokens:
        return None
    caches = {"verifier": models.verifier.prefix.blocks,
              **{f"drafter {d.name}": d.prefix for d in models.loaded_drafters() if d.prefix.on}}
    out = {}
    for name, cache in caches.items():
        s = cache.stats
        out[name] = {"lookups": s.lookups, "hits": s.hits, "hit_rate": round(s.hits / s.lookups, 4) if s.lookups
                     else None, "hit_tokens": s.hit_tokens, "saved_prefill_tokens": s.saved_tokens,
                     "evictions": s.evictions, "cached_tokens": cache.tokens}
    return out
