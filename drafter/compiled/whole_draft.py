"""A whole EAGLE-2 draft as one compiled graph (``--compile`` on a feature-head drafter, CPU).

With its levels compiled (``drafter.compiled.head_levels``), a cycle of the demo
EAGLE head still spent ~3 ms of its ~18 ms outside the graphs: building the
tree level by level in Python (the frontier's attention mask, top-k and the
value temperature per level, the pool's bookkeeping, the rerank), five levels
a cycle, ~40 small tensor operations each. That work has fixed shapes for a
given tree budget (depth, expand_k, total_tokens), so it runs here inside one
graph with the head's levels (``TreeDraftStep``), as ``specdec.tree.build`` builds
the tree:

- level 0 takes the root's log-probs (the fed pairs' last output), each later
  level runs the head on its frontier of ``expand_k`` nodes, writing their K/V
  into draft slots after the committed ones of the session's stacked buffer
  (the caller drops them afterwards, as it does on the Python path);
- each node's children are its ``expand_k`` most likely tokens, their values
  the parent's plus the (value-tempered) log-prob; the next frontier is the
  ``expand_k`` best children by value (ties to the earlier), and the tree the
  ``total_tokens - 1`` best nodes of the pool, in pool order;
- exactness: ``specdec.tree.build`` gives tied log-probs to the lower token id,
  which a compiled top-k does not promise; the graph ranks each row's
  candidates by an integer key that does (``specdec.tree.ranked.top_untied``:
  a half-precision head's logits tie often) and flags a row whose best is not
  a log-prob or whose tie at the k-th place runs past its candidates. A
  flagged draft is thrown away and drafted again level by level (the Python
  builder raises its errors), so every tree is the one the level-by-level
  path drafts from the same log-probs;
- the graph also places the tree for its verify (``specdec.tree.placed``:
  tokens, positions, slots, and the mask's and the walk's bit sets, built
  from the parents), so an in-process verifier runs it before anything is
  read (a ``DeviceTree``) and reads the draft with its verdict: one read a
  cycle (a flagged draft's verify is thrown away for the level path's).

It serves greedy-style drafts only: top-token proposals, the eagle2 method,
no excluded tokens, and the tree budget it was built for (the default one,
at start-up, or the one an in-process run names: ``use_budget``) or a
shallower tree of that budget (a request's last cycles draft no deeper than
the tokens left: the graph drafts its whole depth and the rerank takes only
the nodes of the asked depth; the pool up to a depth is the same whatever
the levels drafted after it, so the tree is the shallower draft's); sampled
proposals, other methods and budgets, drafting ahead's wider trees, and a
session whose draft would pass ``HEAD_CAPACITY`` take the level-by-level
path. On a GPU the levels replay as CUDA graphs already and
this graph is not built (untested there).
"""

from __future__ import annotations

import inspect
import logging
import time

import torch
from transformers.cache_utils import Cache

from specdec.compile.fixed_graphs import FixedGraphs
from specdec.compile.fixed_kv import FixedLayer, fixed_buffers
from specdec.model import kv
from specdec.request.params import TreeParams
from specdec.compile.forwards import width_bucket
from specdec.tree import placed, ranked
from specdec.tree.build import DraftTree
from specdec.tree.placed import DeviceTree, PlacedTree
from drafter.base import on_device
from drafter.compiled import head_levels
from drafter.compiled.head_levels import HEAD_CAPACITY, CompiledHead, HeadKey

log = logging.getLogger(__name__)


def _best(key: torch.Tensor, k: int) -> torch.Tensor:
    """``specdec.tree.layout.best_positions`` inside the graph: the positions of
    the k largest keys (ties: earlier first), ascending."""
    return torch.sort(key, descending=True, stable=True).indices[:k].sort().values


class TreeDraftStep(torch.nn.Module):
    """One EAGLE-2 draft of a fixed budget as a fixed-shape forward (module doc)."""

    def __init__(self, head_step: torch.nn.Module, levels: int, expand_k: int, total: int, width: int):
        super().__init__()
        self.step = head_step                   # ``drafter.compiled.head_levels.HeadStep``: the head and its tensors
        self.levels, self.k, self.total = levels, expand_k, total
        self.width = width                      # the placed tree's: the compiled verify's for ``total`` nodes
                                                # (None: none is that wide, the tree is not placed)

    def _placed(self, tokens, parents, depths, depth, prefix):
        """The tree (pool-order tokens, tree parents and depths [n]; the nodes
        deeper than ``depth`` are pads) placed after ``prefix`` slots,
        ``self.width`` wide, as ``specdec.tree.placed.place_tree`` places it
        from the host's lists: [ROWS, width] int64."""
        n, width = self.total, self.width
        index = torch.arange(n, device=tokens.device)
        bit = torch.bitwise_left_shift(torch.ones_like(index), index)
        parent = parents.clamp(min=0)
        path = torch.where(index > 0, bit, 0)              # a node's path below the root, as bits
        for _ in range(self.levels - 1):                   # one more ancestor a round
            path = torch.where(index > 0, bit | path[parent], 0)
        twin = ((parent[:, None] == parent[None, :]) & (tokens[:, None] == tokens[None, :])
                & (index[None, :] < index[:, None]) & (index[None, :] > 0))          # an earlier sibling's token
        step = torch.where((index > 0) & ~twin.any(-1), bit, 0)
        real = torch.cat([depths <= depth, torch.zeros(width - n, dtype=torch.bool, device=tokens.device)])

        def wide(row):
            return torch.cat([row, row.new_zeros(width - n)])

        columns = torch.arange(width, device=tokens.device)
        bits = torch.bitwise_left_shift(torch.ones_like(columns), columns)
        last = prefix + torch.where(depths <= depth, depths, 0).max()                 # the deepest real node's
        rows = {placed.TOKENS: wide(tokens), placed.POSITIONS: prefix + wide(depths), placed.SLOTS: prefix + columns,
                placed.SEEN: wide(path | 1), placed.BITS: bits, placed.PARENTS: wide(parent),
                placed.PATH: wide(path), placed.STEP: wide(step)}
        pads = {placed.POSITIONS: last, placed.SEEN: bits}
        return torch.stack([torch.where(real, rows[r], pads.get(r, 0)) if r != placed.SLOTS and r != placed.BITS
                            else rows[r] for r in range(placed.ROWS)])

    def _top(self, logp: torch.Tensor, temperature: torch.Tensor):
        """The k best tokens of each row [f, V] (value-tempered log-probs
        [f, k], tokens [f, k]) and whether the ranking is exact
        (``specdec.tree.ranked.top_untied``; ``specdec.tree.build._top_tokens`` otherwise decides)."""
        lp, tok, ok = ranked.top_untied(logp, self.k)
        lse = torch.logsumexp(logp.float() / temperature, dim=-1, keepdim=True)
        tempered = torch.where(torch.isfinite(lse), (lp / temperature - lse).clamp(max=0.0), lp)
        return torch.where(temperature == 1.0, lp, tempered), tok, ok

    def forward(self, root_token, root_hidden, root_logp, committed, temperature, depth, stack):
        """root_token [1] int64; root_hidden [H]; root_logp [V]; committed [1]
        (the session's cached slots); temperature [1] fp32 (the values'); depth
        [1] int64 the tree's depth (<= the levels drafted: a shallower tree takes
        only the nodes up to it, and only those above it were expanded); stack
        the head's stacked cache [1, 2, 1, heads, C, d], draft K/V written past
        ``committed``. Returns what the host reads [1 + 4n] fp64 (whether the
        draft is exact, False: draft it level by level; then the tree's tokens,
        parents, depths and values [n]), its nodes' outputs [n, H] (zeros
        where a node was not expanded) and the tree placed for its verify after
        ``committed`` slots (a feature head's committed inputs are the
        committed tokens but the root: the verifier's prefix too)."""
        k, capacity = self.k, stack.shape[4]
        drafter = self.step.drafter.reading({name: getattr(self.step, name) for name in self.step.names})
        hidden_size = root_hidden.shape[-1]
        lp, tok, ok = self._top(root_logp[None], temperature)                     # [1, k]
        tokens = torch.cat([root_token, tok[0]])                                  # the pool, in creation order
        parents = torch.cat([torch.full_like(root_token, -1), torch.zeros_like(tok[0])])
        depths = torch.cat([torch.zeros_like(root_token), torch.ones_like(tok[0])])
        values = torch.cat([torch.zeros_like(lp[0, :1]), lp[0]])
        frontier = torch.arange(1, k + 1, device=stack.device)                    # all k of the root's children
        front_tokens, front_parent_h = tok[0], root_hidden[None].expand(k, hidden_size)
        sees = torch.zeros(k, capacity, dtype=torch.bool, device=stack.device)   # the parents' draft slots
        slot_ids = torch.arange(capacity, device=stack.device)
        committed_seen = slot_ids < committed                                     # [C]
        expanded, outputs = [torch.zeros_like(root_token)], [root_hidden[None]]
        for level in range(1, self.levels):
            slots = committed + (level - 1) * k + torch.arange(k, device=stack.device)     # [k]
            seen = sees | (slot_ids[None] == slots[:, None])                       # ancestors' and own
            mask = torch.where(committed_seen[None] | seen, 0.0, torch.finfo(stack.dtype).min).to(stack.dtype)
            positions = (committed - 1 + level).expand(k)
            cache = Cache(layers=[FixedLayer(stack, 0, slots)])
            out = drafter.head(drafter.embed_tokens(front_tokens[None]), front_parent_h[None].to(stack.dtype),
                               positions[None], mask[None, None], cache)[0]                  # [k, H]
            expanded.append(frontier)
            outputs.append(out.float())
            lp, tok, level_ok = self._top(drafter.logprobs(out), temperature)      # [k, k]
            ok = ok & level_ok
            kid_parents = frontier.repeat_interleave(k)
            kids = tokens.shape[0] + torch.arange(k * k, device=stack.device)
            kid_values = values[kid_parents] + lp.flatten()
            tokens = torch.cat([tokens, tok.flatten()])
            parents = torch.cat([parents, kid_parents])
            depths = torch.cat([depths, depths[kid_parents] + 1])
            values = torch.cat([values, kid_values])
            pick = _best(kid_values, k)                                            # the next frontier
            frontier, front_tokens = kids[pick], tok.flatten()[pick]
            front_parent_h, sees = out[pick // k], seen[pick // k]
        # the rerank over the nodes up to ``depth`` (pool order is depth order: the others, if picked for want
        # of nodes, come last and the host drops them); -inf keys tie with a node of value -inf, which is earlier
        keep = _best(torch.where(depths[1:] <= depth, values[1:], -float("inf")), self.total - 1) + 1
        ids = torch.cat([torch.zeros_like(keep[:1]), keep])                        # [n], pool order
        where = torch.full_like(tokens, -1).index_copy(0, ids, torch.arange(self.total, device=stack.device))
        tree_parents = torch.cat([torch.full_like(ids[:1], -1), where[parents[ids[1:]]]])
        pool_hidden = torch.zeros(tokens.shape[0], hidden_size, device=stack.device).index_copy(
            0, torch.cat(expanded), torch.cat(outputs))
        pool_hidden = torch.where((depths < depth)[:, None], pool_hidden, 0.0)   # a shallower tree's leaves: none
        # what the host reads of the draft, in one tensor (token ids < 2**53 and fp32 values are exact in fp64)
        read = torch.cat([ok.reshape(1).double(), tokens[ids].double(), tree_parents.double(), depths[ids].double(),
                          values[ids].double()])
        if self.width is None:                                                     # too wide to place
            return read, pool_hidden[ids], torch.zeros(placed.ROWS, 0, dtype=torch.long, device=stack.device)
        return read, pool_hidden[ids], self._placed(tokens[ids], tree_parents, depths[ids], depth, committed)


class CompiledTree:
    """The whole-draft graph of one feature-head drafter at one tree budget (module doc)."""

    def __init__(self, head: CompiledHead, cfg: TreeParams):
        self.drafter, self.head = head.drafter, head
        self.levels = min(cfg.depth, cfg.total_tokens - 1)
        self.expand_k, self.total = cfg.expand_k, cfg.total_tokens
        self.drafts = 0                          # drafts this graph served (``draft``)
        # the graph's scalar inputs, kept on the device and filled per draft (a fill, not a copy up);
        # drafts run one at a time, on the engine's one thread (``specdec.serving.engine_servicer``)
        dev = head.device
        self.root, self.committed, self.depth = (torch.zeros(1, dtype=torch.long, device=dev) for _ in range(3))
        self.depth_held = 0                      # what ``depth`` holds
        self.temperature = torch.ones(1, device=dev)
        self.tempered = 1.0                      # what ``temperature`` holds
        self.width = width_bucket(self.total)    # None: too wide for a placed tree (``specdec.tree.placed``)
        step = TreeDraftStep(head.steps.module, self.levels, self.expand_k, self.total, self.width).eval()
        # keyed as the levels' packages are, and by the modules it reads the head and ranks its top-k through
        sources = tuple({inspect.getfile(type(m)) for m in self.drafter.head.modules()}
                        | {inspect.getfile(type(self.drafter)), inspect.getfile(head_levels), inspect.getfile(ranked)})
        self.graphs = FixedGraphs(step, HeadKey(self.drafter), head.dtype, head.device, ahead_of_time=True,
                                  packed=head.steps.packed, sources=sources,
                                  packaged_capacities=(HEAD_CAPACITY,),
                                  variant=f"tree-l{self.levels}-k{self.expand_k}-n{self.total}")

    def serves(self, cfg: TreeParams, committed: int) -> bool:
        """Whether a draft of budget ``cfg`` after ``committed`` cached slots takes
        this graph: its budget, as deep or shallower."""
        return (cfg.method == "eagle2" and cfg.expand_k == self.expand_k and cfg.total_tokens == self.total
                and 1 <= min(cfg.depth, cfg.total_tokens - 1) <= self.levels
                and committed + (self.levels - 1) * self.expand_k <= HEAD_CAPACITY)

    def _example(self) -> tuple:
        d = self.drafter
        stack = self.head.new_stack()
        return (torch.zeros(1, dtype=torch.long), torch.zeros(d.hidden_size, dtype=torch.float32),
                torch.full((d.vocab_size,), -float(torch.log(torch.tensor(float(d.vocab_size))))),
                torch.ones(1, dtype=torch.long), torch.ones(1), torch.full((1,), self.levels), stack)

    @torch.inference_mode()
    def draft(self, cache, root_token: int, root_hidden: torch.Tensor, root_logp: torch.Tensor,
              temperature: float, depth: int | None = None, fallback=None
              ) -> tuple[DraftTree | DeviceTree, torch.Tensor] | None:
        """The tree (and its nodes' outputs [n, H] fp32, on the device) drafted after the
        session's cached slots in ``cache``, ``depth`` deep (None: the graph's
        levels); None where the draft must be taken level by level (a tie or a
        non-log-prob in a top-k, or no stacked cache). With ``fallback`` (the
        same draft level by level, a callable) the tree stays on the device,
        unread: a ``DeviceTree`` placed after the cache's slots, whose reader
        takes ``fallback`` where the graph flagged its draft."""
        fixed = fixed_buffers(cache)
        if fixed is None:
            return None
        dev = self.head.device
        committed = kv.seq_len(cache)
        graph = self.graphs.get(self.expand_k, HEAD_CAPACITY, self._example)
        self.root.fill_(root_token)
        self.committed.fill_(committed)
        if float(temperature) != self.tempered:
            self.temperature.fill_(float(temperature))
            self.tempered = float(temperature)
        depth = self.levels if depth is None else depth
        if depth != self.depth_held:
            self.depth.fill_(depth)
            self.depth_held = depth
        packed, hidden, rows = graph(
            self.root, on_device(root_hidden, dev, torch.float32).reshape(-1), on_device(root_logp, dev).reshape(-1),
            self.committed, self.temperature, self.depth, fixed.stack)
        kept = 1 + min(self.total - 1, self.expand_k + (depth - 1) * self.expand_k ** 2)   # the pool up to depth
        if self.width is not None and width_bucket(kept) < self.width:    # a shallower tree: its own width
            rows = rows[:, :width_bucket(kept)].contiguous()                # (the columns past it are pads)
        tree = DeviceTree(packed, PlacedTree(rows, kept, committed), root_token, depth, fallback)
        if fallback is not None and self.width is not None:
            self.drafts += 1
            return tree, hidden[:kept]          # (read with the verify's result, ``specdec.tree.placed``)
        if tree.resolve(packed.tolist()) is None:           # the draft's one read
            return None
        self.drafts += 1
        return tree.materialize(), hidden[:kept]     # (on the device: drafting ahead steps from it there)

    def warm(self) -> float:
        """Build (or load) the graph and run it once; seconds taken."""
        t = time.perf_counter()
        self.graphs.get(self.expand_k, HEAD_CAPACITY, self._example)(*self._example())
        return time.perf_counter() - t


def check_tree(tree: CompiledTree) -> str | None:
    """Why the whole-draft graph cannot serve its drafter (None: it can): a
    greedy session over random pairs must draft, through the graph, the tree
    (and values) the level-by-level path drafts."""
    drafter = tree.drafter
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, drafter.vocab_size, (9,), generator=gen).tolist()
    features = torch.randn(8, drafter.feature_size, generator=gen)
    cfg = TreeParams(total_tokens=tree.total, depth=tree.levels, expand_k=tree.expand_k)
    trees, served, had = {}, tree.drafts, drafter.compiled_tree
    for run in ("graph", "levels"):
        drafter.compiled_tree = tree if run == "graph" else None
        sid = f"whole-draft-check-{run}"
        drafter.prefill(sid, tokens, features, greedy=True)
        try:
            trees[run] = drafter.draft(sid, cfg)
        finally:
            drafter.release(sid)
            drafter.compiled_tree = had                 # (the caller installs this one if it passes)
    if tree.drafts != served + 1:
        return "the check's draft did not take the graph"
    got, want = trees["graph"], trees["levels"]
    if not (torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)):
        return "it drafts another tree than the level-by-level path"
    err = float((got.values - want.values).abs().max())
    if not err <= (1e-4 if tree.head.dtype == torch.float32 else 5e-2):
        return f"its node values differ from the level-by-level ones (by {err:.2g})"
    return None


def compile_tree(head: CompiledHead | None, cfg: TreeParams | None = None) -> CompiledTree | None:
    """The whole-draft graph over compiled levels ``head`` at budget ``cfg``
    (None: the default one), or None: no compiled levels, not on CPU, or the
    build or the check failed (one log line says why: drafts then go level by
    level)."""
    if head is None or head.device.type != "cpu" or head.steps.packages is None:
        return None
    cfg = cfg or TreeParams()
    name = getattr(head.drafter, "name", "head")
    t = time.perf_counter()
    try:
        tree = CompiledTree(head, cfg)
        tree.warm()
        reason = check_tree(tree)
    except Exception as exc:  # noqa: BLE001 - any failure means: draft level by level
        reason = f"compilation failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    if reason is not None:
        log.warning("whole-draft graph off for the %s drafter: %s; drafting level by level", name, reason)
        return None
    log.info("whole-draft graph on for the %s drafter (budget %d nodes, depth %d, expand_k %d; %.1f s to build "
             "or load and check)", name, tree.total, tree.levels, tree.expand_k, time.perf_counter() - t)
    return tree


def use_budget(drafter, cfg: TreeParams) -> None:
    """Give ``drafter`` the whole-draft graph of budget ``cfg`` in place of the
    default budget's, where it has compiled levels and no graph serving that
    budget yet: an in-process run that knows its tree (``generate --local``,
    ``bench``) then drafts all of it in one graph. A failed build keeps the
    graph it had (one log line says why)."""
    current = getattr(drafter, "compiled_tree", None)
    if getattr(drafter, "compiled", None) is None or cfg.method != "eagle2" or (
            current is not None and current.serves(cfg, 0)):
        return
    tree = compile_tree(drafter.compiled, cfg)
    if tree is not None:
        drafter.compiled_tree = tree
