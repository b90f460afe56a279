"""The speculative loop: one generation, whatever runs the models (DESIGN.md §1, §9).

Per request:
  1. prefill: the verifier runs the prompt and picks the first token (with the
     prompt's features when the drafter needs them); the drafter is prefilled
     with prompt + first token;
  2. per cycle, until a stop condition (``Decoding``):
     a. plan: this cycle's tree knobs, never deeper than the tokens still
        wanted and no wider than the session's share of the verifier's token
        budget; none (a root-only tree: plain decoding) while the speculation
        gate pauses drafting, or with no drafter;
     b. draft: the tree drafted one round ahead for what the last cycle
        committed, else a fresh draft carrying the commits the drafter has not
        seen yet;
     c. verify: the verifier accepts a path of the tree and adds a bonus token
        (it commits them); with lookahead, the drafter meanwhile drafts the next
        round for the tree's likeliest outcomes;
     d. commit: the new tokens into the ``Decoding`` (EOS, max_new_tokens, stop
        strings), the gate and the statistics; they wait, with their features,
        for the drafter's next draft; the listener hears them while the next
        call is in flight (streaming is off the critical path);
  3. release both sessions, whatever happened (shielded from cancellation).

The loop is torch-free (the orchestrator runs it, or on the direct plane
the verifier, ``verifier.plane``): it sees token ids, a tree
as an opaque value it hands from the drafter to the verifier (``Draft``, with
its size), the verifier's answer (``Committed``: tokens, accepted node
indices, features as an opaque payload for the drafter, the tokens' logprobs
when the session asked for them) and the decoding
state. ``Verifier`` and ``Drafter`` are the two interfaces it is written
against: ``specdec.local`` implements them over the in-process engines,
``orchestrator.failover`` over gRPC stubs, with failover inside. Method
LOOKAHEAD (lookahead decoding) has no drafter: the loop's ``SelfDrafter``
hands the verifier a ``SelfDraft`` and the verifier drafts the tree itself.

Time split (``DecodeStats.time_s``): prefill (the verifier's prefill), commit
(the drafter's prefill), draft, verify, network (what a backend spent in
transport, from its ``network_s``); drafting ahead counts as draft only where
the verify did not hide it. The rest of the wall time is the caller's own.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Awaitable, Protocol

from specdec.request.decoding import Decoding
from specdec.request.pace import Pace
from specdec.request.params import LOOKAHEAD, SamplingParams, TreeParams

MIN_SHARED_TREE = 4     # a tree cut for load keeps at least this many nodes (root included)


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    sampling: SamplingParams
    tree: TreeParams | None             # None: plain decoding (root-only trees)
    lookahead: int = 0                  # outcomes drafted one round ahead per cycle (greedy sessions)
    verify_token_budget: int = 0        # >0: tree nodes one verifier step carries over all its sessions


@dataclass(frozen=True)
class Committed:
    """What the verifier committed in one step: prefill (the first token) or a cycle."""

    tokens: list[int]                   # accepted draft tokens + the bonus token (prefill: the first token)
    accepted: list[int]                 # accepted node indices, root excluded (prefill: none)
    features: object = None             # the target's features for the drafter, opaque here
    logprobs: list | None = None        # one ``specdec.request.params.TokenLogprob`` per token, when the session asked
    nodes: int = 0                      # nodes the verifier checked (fewer than drafted when it cut the tree
                                        # to its cost, ``specdec.tree.sizing``); 0: the draft's size
    prompt_logprobs: list | None = None  # prefill: one per prompt token but the first, when the session asked
    token_ids: object = None            # ``tokens`` on the verifier's device, opaque here (in-process: the
                                        # drafter feeds them with no upload); None: not there


@dataclass(frozen=True)
class Draft:
    tree: object                        # the drafter's tree, opaque here; node 0 is the last committed token
    size: int                           # nodes, root included


@dataclass(frozen=True)
class SelfDraft:
    """The tree of a ``Draft`` the verifier drafts itself from the target
    (lookahead decoding, ``specdec.tree.lookahead``), at most ``depth`` levels deep."""

    depth: int


class SelfDrafter:
    """The loop's drafter for method LOOKAHEAD: nothing to prefill or commit;
    each draft tells the verifier to draft the cycle's tree itself
    (``SelfDraft``). The loop plans, gates and counts its cycles as any drafter's."""

    network_s = 0.0
    needs_features = False
    drafts_ahead = False

    async def prefill(self, tokens: list[int], features: object, sampling: SamplingParams) -> None:
        return None

    async def draft(self, commits: list[Committed], tree: TreeParams, ahead: bool) -> Draft:
        return Draft(SelfDraft(tree.depth), 1)       # its size is the verifier's to tell (``Committed.nodes``)

    async def draft_ahead(self, commits: list[Committed], tree: TreeParams, count: int,
                          tokens_left: int) -> dict[tuple[int, ...], Draft]:
        return {}

    async def release(self) -> None:
        return None


class Verifier(Protocol):
    """One session on a verifier."""

    network_s: float                    # seconds its calls spent in transport so far (0 in-process)

    @property
    def sessions(self) -> int:
        """Sessions sharing this verifier's steps (divides the verify token budget)."""

    async def prefill(self, prompt: list[int], sampling: SamplingParams, max_new_tokens: int,
                      features: bool) -> Committed:
        """Open the session on ``prompt``; ``features``: return the prompt's."""

    async def verify(self, draft: Draft | None, features: bool) -> Committed:
        """Verify and commit ``draft`` (None: the last committed token alone)."""

    async def release(self) -> None: ...


class Drafter(Protocol):
    """One session on a drafter. ``draft`` returning None means the session has
    no drafter any more: the loop goes on as plain decoding."""

    network_s: float

    @property
    def needs_features(self) -> bool:
        """The verifier's features must come with every commit."""

    @property
    def drafts_ahead(self) -> bool: ...

    async def prefill(self, tokens: list[int], features: object, sampling: SamplingParams) -> None:
        """``tokens``: prompt + first token; ``features``: the prompt's (when needed)."""

    async def draft(self, commits: list[Committed], tree: TreeParams, ahead: bool) -> Draft | None:
        """Take ``commits`` (made since the last draft), then draft a tree; ``ahead``:
        keep what ``draft_ahead`` needs to draft the next round from it."""

    async def draft_ahead(self, commits: list[Committed], tree: TreeParams, count: int,
                          tokens_left: int) -> dict[tuple[int, ...], Draft]:
        """Take ``commits``, then draft the next round for the ``count`` likeliest
        outcomes of the tree being verified: {outcome tokens: its tree}."""

    async def release(self) -> None: ...


class Listener(Protocol):
    """What the caller hears while the loop runs (the orchestrator streams and counts)."""

    async def committed(self, tokens: list[int]) -> None:
        """Tokens became final (``Decoding.add``'s answer, possibly none)."""

    def drafted_ahead(self, hit: bool) -> None:
        """Trees were drafted ahead last cycle; ``hit``: one is this cycle's."""


def shared_tree_tokens(budget: int, sessions: int) -> int:
    """This session's tree size when ``sessions`` share a verify budget of ``budget`` nodes."""
    return max(MIN_SHARED_TREE, budget // max(1, sessions))


def cycle_tree(tree: TreeParams, remaining: int, share: int = 0) -> TreeParams | None:
    """The knobs of a cycle that may commit ``remaining`` more tokens: never
    deeper than remaining - 1 (the bonus token is the last), at most ``share``
    nodes (0: no cap). None: nothing left to draft for (a root-only tree)."""
    if remaining <= 1:
        return None
    depth = min(tree.depth, remaining - 1)
    total = min(tree.total_tokens, share) if share else tree.total_tokens
    if (depth, total) == (tree.depth, tree.total_tokens):
        return tree
    return replace(tree, depth=depth, total_tokens=total)


def overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Length of the intersection of two time intervals."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


class SpeculativeLoop:
    """One request through ``verifier`` and ``drafter`` (None: plain decoding), into ``decoding``."""

    def __init__(self, verifier: Verifier, drafter: Drafter | None, request: Request, decoding: Decoding,
                 listener: Listener | None = None, pace: Pace | None = None):
        self.verifier = verifier
        if request.tree is not None and request.tree.method == LOOKAHEAD:
            drafter = SelfDrafter()                          # the verifier drafts from the target itself
        self.drafter = drafter if request.tree is not None else None
        self.backends = [b for b in (verifier, drafter) if b is not None]   # released at the end
        self.request = request
        self.dec = decoding
        self.listener = listener
        self.times = decoding.stats.time_s
        self.pending: list[Committed] = []                  # committed, not yet given to the drafter
        self.ahead: dict[tuple[int, ...], Draft] = {}       # outcome tokens -> tree drafted for it
        self.last: tuple[int, ...] = ()                     # what the last cycle committed
        self.hit = False                                    # this cycle's tree was drafted ahead
        self.delivering: asyncio.Future | None = None       # the listener hearing the last commit
        self.cycle_start = 0.0                              # when this cycle began (perf_counter)
        # a greedy session's output never depends on which cycles draft: its gate may go by the clock,
        # and by what the sessions before it measured on the same verifier–drafter pair (``pace``)
        decoding.gate.paced = request.sampling.greedy
        if pace is not None and self.drafter is not None:
            decoding.gate.share(pace)

    async def run(self) -> Decoding:
        try:
            await self.prefill()
            while not self.dec.done:
                await self.between_cycles()
                self.cycle_start = time.perf_counter()
                tree = self.plan()
                draft = await self.draft(tree)
                result = await self.verify(draft, tree)
                await self.commit(draft, result)
            await self.delivered()
        except Exception:
            if self.delivering is not None:     # what was committed reaches the listener before the error
                await asyncio.gather(self.delivering, return_exceptions=True)
            raise
        finally:
            if self.delivering is not None and not self.delivering.done():
                self.delivering.cancel()
            await asyncio.shield(self.release())
        self.dec.finish()
        return self.dec

    # -- the steps --------------------------------------------------------------------
    async def prefill(self) -> None:
        req = self.request
        first = await self.timed("prefill", self.verifier, self.verifier.prefill(
            req.prompt, req.sampling, self.dec.stop.max_new_tokens, self.wants_features))
        self.dec.prompt_logprobs = first.prompt_logprobs or []
        await self.add(first.tokens, first.logprobs)     # (none taken with max_new_tokens 0)
        if self.drafter is not None and not self.dec.done:
            await self.timed("commit", self.drafter, self.drafter.prefill(
                req.prompt + first.tokens, first.features, req.sampling))

    async def between_cycles(self) -> None:
        """Before each cycle, with every commit so far taken in (a subclass's hook: nothing here)."""

    def plan(self) -> TreeParams | None:
        """This cycle's tree knobs; None: a root-only cycle."""
        if self.drafter is None or not self.dec.gate.speculate():
            return None
        budget = self.request.verify_token_budget
        share = shared_tree_tokens(budget, self.verifier.sessions) if budget > 0 else 0
        return cycle_tree(self.request.tree, self.remaining, share)

    async def draft(self, tree: TreeParams | None) -> Draft | None:
        """The tree drafted ahead for the last outcome, else a fresh one; None: root only."""
        draft = self.ahead.get(self.last) if tree is not None else None
        self.hit = draft is not None
        self.dec.stats.ahead_hits += self.hit
        if self.ahead and self.listener is not None:
            self.listener.drafted_ahead(draft is not None)
        self.ahead = {}
        if draft is None and tree is not None:
            draft = await self.timed("draft", self.drafter, self.drafter.draft(
                self.take_pending(), tree, ahead=self.looks_ahead))
            if draft is None:               # no drafter left: plain decoding from now on
                self.drafter, self.pending = None, []
        return draft

    async def verify(self, draft: Draft | None, tree: TreeParams | None) -> Committed:
        """Verify ``draft``; with lookahead, draft the next round meanwhile (into ``self.ahead``)."""
        verifying = self.timed("verify", self.verifier, self.verifier.verify(draft, self.wants_features))
        if draft is None or not self.looks_ahead:
            return await verifying
        span = [0.0, 0.0]

        async def verify_spanned() -> Committed:
            span[0] = time.perf_counter()
            try:
                return await verifying
            finally:
                span[1] = time.perf_counter()

        task = asyncio.ensure_future(verify_spanned())
        try:
            start = time.perf_counter()
            self.ahead = await self.drafter.draft_ahead(self.take_pending(), tree, self.request.lookahead,
                                                        self.remaining)
            drafting = (start, time.perf_counter())
            result = await task
        finally:
            if not task.done():
                task.cancel()
        # in-process the two run one after the other; over gRPC the verify hides the drafting
        self.times["draft"] += drafting[1] - drafting[0] - overlap(drafting, (span[0], span[1]))
        return result

    async def commit(self, draft: Draft | None, result: Committed) -> None:
        size = result.nodes or (draft.size if draft is not None else 1)
        self.dec.stats.record_cycle(size, len(result.accepted))
        self.dec.stats.ahead_committed += len(result.tokens) if self.hit else 0
        # timed as what it cost: a drafted tree the verifier cut to its root is neither kind of cycle;
        # counted as what it was, a drafted cycle (the draft was paid) that committed its one token,
        # so a session whose trees the verifier keeps cutting (cost sizing where wide verifies are
        # dear, a verify budget under load) pauses its drafting instead of paying for it every cycle
        timed = (draft is None) == (size == 1)
        self.dec.gate.record(draft is not None, len(result.tokens),
                             time.perf_counter() - self.cycle_start if timed else None)
        self.last = tuple(result.tokens)
        await self.add(result.tokens, result.logprobs)
        if self.drafter is not None and not self.dec.done:
            self.pending.append(result)

    async def release(self) -> None:
        await asyncio.gather(*(backend.release() for backend in self.backends))

    # -- bookkeeping -----------------------------------------------------------------------
    @property
    def remaining(self) -> int:
        return self.dec.stop.max_new_tokens - len(self.dec.tokens)

    @property
    def wants_features(self) -> bool:
        return self.drafter is not None and self.drafter.needs_features

    @property
    def looks_ahead(self) -> bool:
        """Draft one round ahead: greedy sessions (the outcome is the target's
        argmax, the most predictable) on a drafter that can."""
        return (self.request.lookahead > 0 and self.drafter is not None and self.request.sampling.greedy
                and self.drafter.drafts_ahead)

    def take_pending(self) -> list[Committed]:
        pending, self.pending = self.pending, []
        return pending

    async def add(self, tokens: list[int], logprobs: list | None = None) -> None:
        """Commit ``tokens`` to the decoding (stop conditions); the listener hears
        them off the critical path: while the next step's call is in flight,
        after it has heard the commits before (in order; its errors surface at
        the next commit or the end)."""
        final = self.dec.add(tokens, logprobs)
        if self.listener is not None:
            await self.delivered()
            self.delivering = asyncio.ensure_future(self.listener.committed(final))

    async def delivered(self) -> None:
        """Until the listener has heard every commit so far."""
        if self.delivering is not None:
            delivering, self.delivering = self.delivering, None
            await delivering

    async def timed(self, bucket: str, session: Verifier | Drafter, call: Awaitable):
        """Await ``call`` on ``session``; its time goes to ``bucket``, but for what
        the session reports as transport, which goes to network."""
        start, network = time.perf_counter(), session.network_s
        try:
            return await call
        finally:
            transport = session.network_s - network
            self.times[bucket] += time.perf_counter() - start - transport
            self.times["network"] += transport


async def speculative_generate(verifier: Verifier, drafter: Drafter | None, request: Request, decoding: Decoding,
                               listener: Listener | None = None, pace: Pace | None = None) -> Decoding:
    """Run ``request`` to completion (``SpeculativeLoop``); returns ``decoding``. ``pace``: the
    verifier–drafter pair's, shared by its greedy sessions' gates (``specdec.request.pace``)."""
    return await SpeculativeLoop(verifier, drafter, request, decoding, listener, pace).run()
