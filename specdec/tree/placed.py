"""A draft tree placed on the model's device for its verify: one upload.

A tree's structure reaches the verifier as host lists (the wire, or a
builder that chose its nodes on the host). Everything its verify needs on the
device comes from them in one host-to-device copy of one int64 tensor
[ROWS, width] (``place_tree``), ``width`` being the padded width of the
compiled forward that runs it (``specdec.compile.forwards``):

- the forward's inputs: tokens, positions (``prefix_len + depth``) and the
  cache slots the new K/V go to (``prefix_len + i``);
- the tree mask, as bits: row ``SEEN`` holds for query i the set of tree
  slots it sees (its ancestors, the root and itself) as an int64 bit set, bit
  j for slot j, which ``specdec.model.masks.bits_masks`` expands on the device;
- greedy acceptance on the device (``specdec.tree.acceptance.greedy_order``):
  each node's parent, the bits of its path below the root (``PATH``), and its
  own bit where it can be the walk's step (``STEP``: 0 for a node an
  earlier sibling carrying the same token always goes before).

Bit sets are int64, so a placed tree is at most 64 wide (``MAX_WIDTH``, the
widest compiled forward); bit 63 is the sign bit, which bitwise operations
treat like any other. Pad columns (i >= n) are queries whose outputs are
dropped: each sees only its own slot, at the last node's position.

A tree drafted on the device (a whole-draft graph, ``drafter.compiled.whole_draft``)
comes placed already, its host lists not read yet: a ``DeviceTree``. An
in-process verifier runs it as it is and reads the draft together with its
own verdict, one read a cycle (``verifier.engine``); anyone else reads it
first (``materialize``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdec.tree.layout import DraftTree, tree_from_lists

MAX_WIDTH = 64
# the rows of the placed tensor
TOKENS, POSITIONS, SLOTS, SEEN, BITS, PARENTS, PATH, STEP = range(8)
ROWS = 8


def _signed(bits: int) -> int:
    """An unsigned 64-bit set as the int64 holding the same bits."""
    return bits - (1 << 64) if bits >= 1 << 63 else bits


@dataclass(frozen=True)
class PlacedTree:
    """A tree of ``n`` nodes on the device, padded to ``width`` columns (module doc)."""

    packed: torch.Tensor          # [ROWS, width] int64 on the device
    n: int
    prefix_len: int               # cached slots before the tree's

    @property
    def width(self) -> int:
        return self.packed.shape[1]

    @property
    def tokens(self) -> torch.Tensor:
        """[1, width] (pads: 0)."""
        return self.packed[TOKENS:TOKENS + 1]

    @property
    def positions(self) -> torch.Tensor:
        """[1, width] (pads: the last node's)."""
        return self.packed[POSITIONS:POSITIONS + 1]

    @property
    def slots(self) -> torch.Tensor:
        """[width]: ``prefix_len + i``."""
        return self.packed[SLOTS]

    def row(self, index: int) -> torch.Tensor:
        """One row of the real nodes: [n]."""
        return self.packed[index, :self.n]


def place_tree(tree, prefix_len: int, width: int, device) -> PlacedTree:
    """``tree`` (a ``DraftTree``: its host lists) after ``prefix_len`` cached
    slots, padded to ``width`` (n <= width <= ``MAX_WIDTH``), on ``device``:
    the verify's one upload."""
    packed = torch.tensor(placed_lists(tree, prefix_len, width), dtype=torch.long, device=device)
    return PlacedTree(packed, tree.size, prefix_len)


def placed_lists(tree, prefix_len: int, width: int) -> list[list[int]]:
    """``place_tree``'s rows as host lists ([ROWS][width]): what several trees
    placed together go up in (a batch's one upload)."""
    tokens, parents, depths = tree.token_list, tree.parent_list, tree.depth_list
    n = len(tokens)
    if not n <= width <= MAX_WIDTH:
        raise ValueError(f"a tree of {n} nodes cannot be placed {width} wide (at most {MAX_WIDTH})")
    seen, path, step = [1], [0], [0]
    taken: set[tuple[int, int]] = set()           # (parent, token) of the siblings so far
    for i in range(1, n):
        p, bit = parents[i], 1 << i
        seen.append(seen[p] | bit)
        path.append(path[p] | bit)
        step.append(0 if (p, tokens[i]) in taken else bit)
        taken.add((p, tokens[i]))
    last = prefix_len + depths[-1]
    pad = range(n, width)
    rows = [tokens + [0] * len(pad),
            [prefix_len + d for d in depths] + [last] * len(pad),
            list(range(prefix_len, prefix_len + width)),
            [_signed(b) for b in seen] + [_signed(1 << i) for i in pad],
            [_signed(1 << i) for i in range(width)],
            [max(p, 0) for p in parents] + [0] * len(pad),
            [_signed(b) for b in path] + [0] * len(pad),
            [_signed(b) for b in step] + [0] * len(pad)]
    return rows


def place_rows(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, steps: torch.Tensor,
               real: torch.Tensor, prefix_len: int, width: int, levels: int) -> torch.Tensor:
    """``place_tree``'s rows built on the device from a tree there (tokens,
    parents (the root's 0), depths [n], n <= width; ``steps`` [n] bool: the
    nodes the walk may take, ``real`` [n] bool: the nodes whose outputs
    count, the others placed as nodes nothing is accepted at; ``levels``: the
    tree's depth at most) -> [ROWS, width] int64, nothing read."""
    n, device = tokens.shape[0], tokens.device
    index = torch.arange(n, device=device)
    bit = torch.bitwise_left_shift(torch.ones_like(index), index)
    path = torch.zeros_like(index)
    for _ in range(levels):                                 # one more ancestor a round
        path = torch.where(index > 0, bit | path[parents], 0)
    columns = torch.arange(width, device=device)
    bits = torch.bitwise_left_shift(torch.ones_like(columns), columns)

    def wide(row, pad):
        return torch.cat([row, pad.expand(width - n)])

    last = prefix_len + torch.where(real, depths, 0).max()
    rows = [wide(tokens, tokens.new_zeros(1)), wide(prefix_len + depths, last.view(1)), prefix_len + columns,
            torch.where(columns < n, wide(path | 1, tokens.new_zeros(1)), bits), bits,
            wide(parents, tokens.new_zeros(1)), wide(path, tokens.new_zeros(1)),
            wide(torch.where(steps, bit, 0), tokens.new_zeros(1))]
    return torch.stack(rows)


_ROOT_ROWS: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def place_root(root: torch.Tensor, prefix_len: int, width: int) -> PlacedTree:
    """A root-only tree whose token is on the device already (the last step's
    draw: ``root`` [1] int64), placed there ``width`` wide after ``prefix_len``
    slots, as ``place_tree`` places it, with nothing uploaded but once per
    width and device (the rows' constant part)."""
    key = (width, root.device)
    if key not in _ROOT_ROWS:
        base = place_tree(_ROOT_ONLY, 0, width, root.device).packed
        shift = torch.zeros_like(base)
        shift[POSITIONS:SLOTS + 1] = 1                     # positions and slots follow the prefix
        unit = torch.zeros_like(base)
        unit[TOKENS, 0] = 1                                # the root's token
        _ROOT_ROWS[key] = base, shift, unit
    base, shift, unit = _ROOT_ROWS[key]
    return PlacedTree(torch.addcmul(torch.add(base, shift, alpha=prefix_len), unit, root), 1, prefix_len)


@dataclass(eq=False)
class DeviceTree:
    """A draft still on the device, placed for its verify: ``read`` [1 + 4N]
    fp64 holds whether the graph's draft is exact (0: take ``fallback``), then
    the pool-order tokens, parents, depths and values of its N nodes, of which
    the first ``placed.n`` are the tree (a shallower tree's deeper nodes come
    last). Nothing of it has reached the host."""

    read: torch.Tensor
    placed: PlacedTree                      # after ``placed.prefix_len`` slots: the drafter's committed inputs
    root: int                               # the tree's root token (the host knows it: the last committed)
    depth: int                              # the deepest node's depth at most
    fallback: Callable[[], DraftTree]       # the same draft level by level, where the graph flagged its own
    # how ``read`` is laid out, where it is not as above: its values -> the tree (None: flagged), and the
    # drawn proposals on the device (a sampled tree, ``specdec.tree.drawn``; its walk: ``sampled_order``)
    parse: Callable[[list[float]], DraftTree | None] | None = None
    table: object | None = None
    _tree: DraftTree | None = field(default=None, repr=False)
    _flagged: bool = field(default=False, repr=False)

    @property
    def size(self) -> int:
        return self.placed.n

    def resolve(self, values: list[float]) -> DraftTree | None:
        """The tree out of ``read``'s values, read by whoever read it (None: the
        graph flagged its draft; ``materialize`` then drafts it again)."""
        if self.parse is not None:
            self._tree = self.parse(values)
            self._flagged = self._tree is None
            return self._tree
        self._tree = tree_of_read(values, self.placed.n)
        self._flagged = self._tree is None
        return self._tree

    def materialize(self) -> DraftTree:
        """The tree on the host: ``read`` read (one sync), or the level-by-level draft where it was flagged."""
        if self._tree is None and not self._flagged:
            self.resolve(self.read.tolist())
        if self._tree is None:
            self._tree = self.fallback()
        return self._tree


def tree_of_read(values: list[float], n: int) -> DraftTree | None:
    """The tree of a device draft's read values (``DeviceTree.read``'s layout:
    the exact flag, then N tokens, parents, depths and values, of which the
    first ``n`` are the tree); None where the draft was flagged."""
    if not values[0]:
        return None
    total = (len(values) - 1) // 4
    toks, pars, deps = ([int(v) for v in values[1 + i * total:1 + i * total + n]] for i in range(3))
    structure = torch.tensor([toks, pars, deps], dtype=torch.int64)        # host copies of the read
    return DraftTree(structure[0], structure[1], structure[2],
                     torch.tensor(values[1 + 3 * total:1 + 3 * total + n], dtype=torch.float32),
                     lists=(toks, pars, deps))


_ROOT_ONLY = tree_from_lists([0], [-1])


def host_tree(tree) -> DraftTree:
    """``tree`` with its host lists: a ``DeviceTree`` read, any other tree as it is."""
    return tree.materialize() if isinstance(tree, DeviceTree) else tree
