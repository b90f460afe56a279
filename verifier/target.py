"""The target model (its sessions' state: ``verifier.session``).

``TargetModel`` splits a causal LM into its body (final hidden states, the
features drafters read) and its head (logits); ``check_tree`` holds the checks
a tree passes before any forward, shared by single and batched verification.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from specdec.compile.batched import compile_batches
from specdec.compile.eager import eager_run
from specdec.compile.forwards import CAPTURED, STARTUP_WIDTHS, WIDTHS, width_bucket
from specdec.compile.startup import compile_captures, compile_target
from specdec.model import kv
from specdec.model.causal_lm import CausalLm
from specdec.model.loading import ModelSpec, load_causal_lm
from specdec.model.masks import tree_allowed
from specdec.model.quantize import PROMPT_ROWS, has_int8, prompt_products
from specdec.request.errors import FailedPrecondition, InvalidArgument
from specdec.tree.build import DraftTree
from specdec.tree.placed import PlacedTree, place_root, place_tree
from verifier.session import TargetSession

log = logging.getLogger(__name__)


class TargetModel:
    """A causal LM split into body (features) and head (logits, with the model's
    own final-logit processing): ``specdec.model.causal_lm``."""

    def __init__(self, spec: ModelSpec, model=None):
        self.spec = spec
        self.lm = CausalLm(model if model is not None else load_causal_lm(spec))
        self.model, self.config = self.lm.model, self.lm.config
        self.vocab_size = int(self.config.get_text_config(decoder=True).vocab_size)
        self.max_positions = int(getattr(self.config.get_text_config(decoder=True), "max_position_embeddings",
                                         None) or 1 << 30)
        self.num_layers = int(self.config.get_text_config(decoder=True).num_hidden_layers)
        self.device = self.lm.device
        self.kv_bytes_per_token = self._measure_kv_bytes()
        self.compiled = compile_target(self.lm, spec.compile, spec.compile_layers)     # None: eager forwards
        self._told_eager_layers = False
        self.int8_prompts = has_int8(self.model)      # a long prompt runs eagerly, int8 products dense (``run``)

    def _measure_kv_bytes(self) -> int:
        """K and V bytes per token, every layer, every key/value head, all ranks
        together: measured on a one-token cache, whatever the model's head layout."""
        cache = self.lm.new_cache(1)
        with torch.inference_mode():
            self.lm.hidden(cache, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), None)
        ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return kv.nbytes(cache) * ranks

    def new_cache(self, capacity: int = 0):
        """A cache that grows in place (``specdec.model.kv``); ``capacity``: slots to allocate up front
        (with compiled forwards: the smallest capacity bucket, moved up as
        the session fills, ``specdec.compile.forwards``)."""
        return self.lm.new_cache(capacity) if self.compiled is None else self.compiled.new_cache()

    def compile_feature_layers(self) -> bool:
        """With compiled forwards, add those returning feature layers (EAGLE-3
        sessions', ``specdec.compile.startup.compile_captures``) if not built yet:
        what an in-process EAGLE-3 drafter asks of its target. Whether they are on."""
        return self.compiled is not None and compile_captures(self.compiled)

    def compile_trees(self, total_tokens: int, open_now: bool = True) -> None:
        """With compiled forwards, the graphs of trees of up to ``total_tokens``
        nodes past the start-up widths (``STARTUP_WIDTHS`` follow the default
        tree) built now where missing and opened before any request (``open_now``;
        else left for a server to open while idle), so that no request builds
        one (minutes for a cold package). A no-op otherwise."""
        wanted = width_bucket(total_tokens) or WIDTHS[-1]
        widths = tuple(w for w in WIDTHS if max(STARTUP_WIDTHS) < w <= wanted)
        if self.compiled is None or not widths:
            return
        self.compiled.warm(widths, ready=())
        if self.compiled.capturing is not None:
            self.compiled.warm(widths, captures=True, ready=())
        if open_now:
            self.compiled.open_all()

    def unbuilt_eager(self, total_tokens: int) -> None:
        """A server's compiled forwards: the graphs of trees of up to
        ``total_tokens`` nodes built now where missing (opened while idle), and
        none ever built on a request: a wider tree's width, whose package is
        not on disk, verifies eagerly (one log line per width) instead of
        holding its request for the build. A no-op without compiled forwards."""
        if self.compiled is not None:
            self.compile_trees(total_tokens, open_now=False)
            self.compiled.build_on_use = False

    def compile_batches(self) -> bool:
        """With compiled forwards, add the batched ones (a verifier that batches:
        ``specdec.compile.batched``). Whether they are on."""
        return self.compiled is not None and compile_batches(self.compiled)

    def batch_cache(self, caches: list, lengths: list[int], n: int, layers: tuple[int, ...] = ()):
        """A cache for one batched forward of ``n`` tokens a row over ``caches``:
        row b holds ``caches[b]``'s first ``lengths[b]`` slots, zeros up to
        the longest, room for the ``n`` tokens after that; a compiled-path one
        where a batched graph serves it (``CompiledForward.batch_cache``)."""
        batch = None if self.compiled is None else self.compiled.batch_cache(caches, lengths, n, layers)
        if batch is None:
            batch = self.lm.new_cache()
            kv.gather_rows(batch, caches, lengths, max(lengths), n)
        return batch

    def append_row(self, cache, batch, row: int, slots: torch.Tensor) -> None:
        """Append row ``row``'s ``slots`` [m] of a ``batch_cache`` to a session's cache."""
        if self.compiled is None or not self.compiled.append_row(cache, batch, row, slots):
            self.fit(cache, slots.numel())
            kv.append_slots(cache, batch, row, slots)

    def reuse(self, batch) -> None:
        """A ``batch_cache`` no longer used: its buffer serves the next batch of its shape (compiled ones)."""
        if self.compiled is not None:
            self.compiled.reuse(batch)

    def batches_row_by_row(self, caches: list, lengths: list[int], n: int, layers: tuple[int, ...] = ()) -> bool:
        """Whether a batch runs best one row at a time: every row's own forward is
        compiled, but no batched graph serves the batch (one eager batched
        forward is slower than the compiled rows; ``specdec.compile.batched``)."""
        return (self.compiled is not None and not self.compiled.serves_batch(lengths, n, layers)
                and all(self.compiled.takes(cache, n, layers) for cache in caches))

    def fit(self, cache, n: int) -> None:
        """Before ``n`` slots are written to ``cache``: with compiled forwards,
        a session's buffer moved up to the capacity bucket that holds them
        (``CompiledForward.fit``), so it stays on the compiled path."""
        if self.compiled is not None:
            self.compiled.fit(cache, n)

    def masks(self, allowed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, resident: bool = False):
        """The attention mask for allowed [B, q, k], query positions [B, q], key positions [B, k]
        (``resident``: made on the device, where they are)."""
        return self.lm.masks(allowed, q_pos, k_pos, resident=resident)

    def forward_tree(self, cache, tree: DraftTree, prefix_len: int, layers: tuple[int, ...] = (),
                     root: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, PlacedTree | None]:
        """``forward`` of ``tree`` after the ``prefix_len`` slots of ``cache``:
        features [n, F], logits [n, V], and the tree placed on the device
        where the compiled path runs it (``specdec.tree.placed``: its one
        upload, the mask built there; a root-only tree whose token is on the
        device already, ``root``, none; None: the forward took the host's
        tokens, positions and mask)."""
        self.fit(cache, tree.size)
        if self.compiled is not None and self.compiled.tree_applies(cache, tree.size, layers):
            width = width_bucket(tree.size)
            placed = place_root(root, prefix_len, width) if root is not None and tree.size == 1 else \
                place_tree(tree, prefix_len, width, self.device)
            return (*self.forward_placed(cache, placed, layers), placed)
        mask = None if tree.size == 1 else self.tree_masks(tree, prefix_len)
        hidden, logits = self.forward(cache, tree.tokens, tree.position_ids(prefix_len), mask, layers)
        return hidden, logits, None

    def forward_placed(self, cache, placed: PlacedTree, layers: tuple[int, ...] = ()
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The compiled forward of a tree placed on the device (``tree_applies``
        once ``fit``): features [n, F], logits [n, V]."""
        final, captured, logits = self.compiled.run_placed(cache, placed, layers)
        return select_features(final, captured, layers, layers)[0], logits[0]

    def tree_masks(self, tree: DraftTree, prefix_len: int):
        """The attention mask for one tree over a prefix of ``prefix_len`` slots."""
        positions = tree.position_ids(prefix_len)
        k_pos = torch.cat([torch.arange(prefix_len), positions])
        return self.masks(tree_allowed(tree.ancestor_mask(), prefix_len)[None], positions[None], k_pos[None])

    @torch.inference_mode()
    def forward(self, cache, tokens: torch.Tensor, positions: torch.Tensor, mask,
                layers: tuple[int, ...] = (), last_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions: [n]; mask from ``tree_masks`` or None (causal).
        Returns features [n, F] (``run``) and fp32 logits [n, V] ([1, V], the
        last token's, with ``last_logits``); appends n slots to cache."""
        hidden, logits = self.forward_batch(cache, tokens[None], positions[None], mask, layers, last_logits)
        return hidden[0], logits[0]

    @torch.inference_mode()
    def forward_batch(self, cache, tokens: torch.Tensor, positions: torch.Tensor, mask,
                      layers: tuple[int, ...] = (), last_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions: [B, n] -> features [B, n, F], fp32 logits [B, n, V] ([B, 1, V] with ``last_logits``)."""
        final, captured, logits = self.run(cache, tokens, positions, mask, layers, last_logits=last_logits)
        return select_features(final, captured, layers, layers), logits

    @torch.inference_mode()
    def run(self, cache, tokens: torch.Tensor, positions: torch.Tensor, mask,
            layers: tuple[int, ...] = (), resident: bool = False, last_logits: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """One forward: the final hidden state [B, n, H] (fp32: EAGLE-1/2's
        feature), the residual stream entering each of ``layers`` (HF
        ``output_hidden_states`` indices: EAGLE-3's features) concatenated
        [B, n, len(layers) H] or None when ``layers`` is empty, fp32 logits [B, n, V].
        The compiled forward runs where it applies (``specdec.compile.forwards``;
        with layers, where its capturing graphs were built); ``resident``:
        tokens, positions and mask are on the device already; ``last_logits``:
        the logits of each row's last token only, [B, 1, V] (a prompt's: an
        eager forward then runs the output head over that one token, a
        vocabulary-sized product per prompt token saved)."""
        self.fit(cache, tokens.shape[1])
        if mask is None and tokens.shape[1] >= PROMPT_ROWS and self.int8_prompts:
            # a prompt over int8 weights: eager, its products dense bf16 ones (faster than the packed
            # kernel, compiled or not, at these widths), the same whether forwards are compiled or not
            with prompt_products():
                return eager_run(self.lm, cache, tokens, positions, mask, layers, last_logits)
        if self.compiled is None:
            out = None
        elif resident:
            out = self.compiled.run(cache, tokens, positions, mask, layers, resident=True)
        else:
            out = self.compiled.run(cache, tokens, positions, mask, layers)
        if out is not None:
            return (*out[:2], out[2][:, -1:]) if last_logits else out
        if layers and self.compiled is not None and not self.compiled.captures(layers) and not self._told_eager_layers:
            self._told_eager_layers = True
            why = ("start the verifier with --compile-feature-layers to compile their forwards too"
                   if self.compiled.capturing is None else f"compiled forwards return at most {CAPTURED}")
            log.warning("sessions asking for %d feature layers verify eagerly: %s", len(layers), why)
        return eager_run(self.lm, cache, tokens, positions, mask, layers, last_logits)

    def check_feature_layers(self, layers) -> tuple[int, ...]:
        layers = tuple(int(i) for i in layers)
        if len(layers) > MAX_FEATURE_LAYERS or not all(0 <= i < self.num_layers for i in layers):
            raise InvalidArgument(f"feature_layers must be at most {MAX_FEATURE_LAYERS} HF hidden-state indices "
                                  f"in [0, {self.num_layers}), got {list(layers)}")
        return layers


MAX_FEATURE_LAYERS = 8


def select_features(final: torch.Tensor, captured: torch.Tensor | None, captured_layers: tuple[int, ...],
                    layers: tuple[int, ...]) -> torch.Tensor:
    """A session's features out of one ``TargetModel.run``: ``final`` [..., H]
    when it asked for no layers, else the chunks of ``captured`` (the layers
    ``captured_layers``, H wide each) for its ``layers``, in its order."""
    if not layers:
        return final
    if tuple(layers) == tuple(captured_layers):
        return captured
    width = final.shape[-1]
    return torch.cat([captured[..., captured_layers.index(i) * width:(captured_layers.index(i) + 1) * width]
                      for i in layers], dim=-1)


def check_tokens(target: TargetModel, tokens: list[int], what: str) -> None:
    bad = next((t for t in tokens if not 0 <= t < target.vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"{what} id {bad} is outside the vocabulary [0, {target.vocab_size})")


def check_tree(target: TargetModel, sess: TargetSession, tree: DraftTree) -> None:
    """A tree rooted at the session's pending token, inside the vocabulary and the context."""
    root = tree.token_list[0]
    if root != sess.tokens[-1]:
        raise FailedPrecondition(
            f"tree root token {root} is not the session's last committed token {sess.tokens[-1]}")
    check_tokens(target, tree.token_list, "tree token")
    deepest = sess.prefix_len + max(tree.depth_list)
    if deepest >= target.max_positions:
        raise InvalidArgument(f"tree reaches position {deepest}, beyond the model's context of "
                              f"{target.max_positions} tokens")
