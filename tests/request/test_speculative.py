"""The speculative loop (specdec.request.speculative) against tiny fakes of its two
interfaces: a verifier whose target is a fixed function of the sequence, and
a drafter that drafts chains of it (right or deliberately wrong).

Covered: output equal to plain decoding, stop conditions, trees trimmed to
the tokens still wanted and to the verify budget share, gate pauses, pending
commits joined into the next draft (with their features), draft-ahead hits,
"no drafter" mid-request, the time split, and release on every exit path
(normal, exceptions, cancellation). The loop never imports torch.
"""

import asyncio
import subprocess
import sys

import pytest

from specdec.request.decoding import Decoding, StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from specdec.request.speculative import (Committed, Draft, Request, cycle_tree, overlap, shared_tree_tokens,
                                         speculative_generate)

VOCAB = 50
GREEDY = SamplingParams()
PROMPT = [3, 14, 15]


def target(seq: list[int]) -> int:
    """The fake target's greedy choice after ``seq``."""
    return (seq[-1] * 31 + len(seq)) % VOCAB


def plain(prompt: list[int], n: int, eos: frozenset[int] = frozenset()) -> list[int]:
    seq, out = list(prompt), []
    while len(out) < n:
        tok = target(seq)
        seq.append(tok)
        out.append(tok)
        if tok in eos:
            break
    return out


class FakeVerifier:
    """Greedy verification of (tokens, parents) trees against ``target``; features
    are ("f", token) per committed row. ``fail_on`` / ``hang_on``: the n-th verify
    (1-based) raises / waits forever."""

    def __init__(self, sessions: int = 1, fail_on: int = 0, hang_on: int = 0, network_per_call: float = 0.0):
        self.sessions = sessions
        self.fail_on, self.hang_on = fail_on, hang_on
        self.network_per_call = network_per_call
        self.network_s = 0.0
        self.committed: list[int] = []
        self.calls: list[tuple[object, bool]] = []        # (tree or None, features asked)
        self.hanging = asyncio.Event()
        self.released = 0

    async def prefill(self, prompt, sampling, max_new_tokens, features):
        self.committed = [*prompt, target(prompt)]
        scored = [("scored", t) for t in prompt[1:]]        # the prompt's logprobs, as a verifier asked for them
        return Committed([self.committed[-1]], [], [("f", t) for t in prompt] if features else None,
                         prompt_logprobs=scored)

    async def verify(self, draft, features):
        self.calls.append((draft.tree if draft is not None else None, features))
        if len(self.calls) == self.fail_on:
            raise RuntimeError("verifier broke")
        if len(self.calls) == self.hang_on:
            self.hanging.set()
            await asyncio.Event().wait()
        if self.network_per_call:
            await asyncio.sleep(2 * self.network_per_call)
            self.network_s += self.network_per_call
        tokens, parents = draft.tree if draft is not None else ([self.committed[-1]], [-1])
        assert tokens[0] == self.committed[-1]
        node, accepted, seq = 0, [], list(self.committed)
        while True:
            want = target(seq)
            child = next((i for i, p in enumerate(parents) if p == node and tokens[i] == want), None)
            if child is None:
                break
            accepted.append(child)
            seq.append(want)
            node = child
        bonus = target(seq)
        new = [tokens[i] for i in accepted] + [bonus]
        self.committed += new
        return Committed(new, accepted, [("f", t) for t in [tokens[0], *new[:-1]]] if features else None)

    async def release(self):
        self.released += 1


class FakeDrafter:
    """Chains of the target's choices (``wrong``: each one off by one); mirrors
    the committed tokens it is told. ``gone_after``: draft n+1 finds no drafter."""

    def __init__(self, wrong: bool = False, needs_features: bool = False, drafts_ahead: bool = False,
                 gone_after: int = 0, fail_prefill: bool = False):
        self.wrong = wrong
        self.needs_features = needs_features
        self.drafts_ahead = drafts_ahead
        self.gone_after = gone_after
        self.fail_prefill = fail_prefill
        self.network_s = 0.0
        self.tokens: list[int] = []
        self.drafts: list[dict] = []
        self.aheads: list[dict] = []
        self.current: list[int] | None = None        # the chain being verified (drafted with ahead=True)
        self.released = 0

    async def prefill(self, tokens, features, sampling):
        if self.fail_prefill:
            raise RuntimeError("drafter broke")
        if self.needs_features:
            assert features == [("f", t) for t in tokens[:-1]]
        self.tokens = list(tokens)

    def take(self, commits):
        for c in commits:
            if self.needs_features:
                assert c.features is not None and len(c.features) == len(c.tokens)
            self.tokens += c.tokens

    def chain(self, seq: list[int], depth: int) -> list[int]:
        seq, out = list(seq), [seq[-1]]
        for _ in range(depth):
            tok = (target(seq) + self.wrong) % VOCAB
            seq.append(tok)
            out.append(tok)
        return out

    async def draft(self, commits, tree, ahead):
        if self.gone_after and len(self.drafts) >= self.gone_after:
            return None
        self.take(commits)
        self.drafts.append({"commits": len(commits), "depth": tree.depth, "total": tree.total_tokens,
                            "known": len(self.tokens)})
        chain = self.chain(self.tokens, min(tree.depth, tree.total_tokens - 1))
        self.current = chain if ahead else None
        return Draft((chain, list(range(-1, len(chain) - 1))), len(chain))

    async def draft_ahead(self, commits, tree, count, tokens_left):
        self.take(commits)
        self.aheads.append({"commits": len(commits), "count": count, "tokens_left": tokens_left})
        if self.current is None:
            return {}
        outcome = self.current[1:] + [target(self.tokens + self.current[1:])]   # the whole chain accepted
        left = tokens_left - len(outcome)
        if left <= 1:
            return {}
        chain = self.chain(self.tokens + outcome, min(tree.depth, left - 1))
        self.current = chain
        return {tuple(outcome): Draft((chain, list(range(-1, len(chain) - 1))), len(chain))}

    async def release(self):
        self.released += 1


class Heard:
    def __init__(self):
        self.tokens: list[int] = []
        self.ahead: list[bool] = []

    async def committed(self, tokens):
        self.tokens += tokens

    def drafted_ahead(self, hit):
        self.ahead.append(hit)


def run(verifier, drafter, n, tree=TreeParams(method="chain", total_tokens=4, depth=3), min_tau=0.0,
        lookahead=0, budget=0, eos=frozenset(), sampling=GREEDY, listener=None):
    request = Request(PROMPT, sampling, tree, lookahead=lookahead, verify_token_budget=budget)
    dec = Decoding(StopCriteria(max_new_tokens=n, eos_ids=eos), min_tau)
    return asyncio.run(speculative_generate(verifier, drafter, request, dec, listener))


# -- output and stop conditions ------------------------------------------------------------------
@pytest.mark.parametrize("drafter", [None, FakeDrafter(), FakeDrafter(wrong=True), FakeDrafter(needs_features=True)],
                         ids=["plain", "right", "wrong", "features"])
def test_output_is_plain_decoding_and_stops_at_max_new_tokens(drafter):
    heard = Heard()
    dec = run(FakeVerifier(), drafter, 17, listener=heard)
    assert dec.tokens == heard.tokens == plain(PROMPT, 17)
    assert dec.finish_reason == "length"
    assert sum(dec.stats.committed_per_cycle) == 16          # the first token came from prefill


def test_right_chains_are_accepted_whole():
    drafter = FakeDrafter()
    dec = run(FakeVerifier(), drafter, 1 + 4 * 5)
    assert dec.stats.cycles == 5 and dec.stats.tau == 4.0 and dec.stats.accepted == 15
    assert dec.stats.drafted == 15 and dec.stats.accepted_per_position == [5, 5, 5]


def test_eos_stops_and_is_kept():
    eos = frozenset({plain(PROMPT, 12)[7]})
    dec = run(FakeVerifier(), FakeDrafter(), 40, eos=eos)
    assert dec.tokens == plain(PROMPT, 40, eos) and dec.tokens[-1] in eos
    assert dec.finish_reason == "eos"


def test_prefill_alone_can_finish():
    verifier, drafter = FakeVerifier(), FakeDrafter()
    dec = run(verifier, drafter, 1)
    assert dec.tokens == plain(PROMPT, 1) and dec.stats.cycles == 0
    assert drafter.tokens == [] and not verifier.calls                  # the drafter was never prefilled
    assert verifier.released == drafter.released == 1


def test_no_new_tokens_is_the_prefill_scoring_the_prompt_alone():
    verifier, drafter, heard = FakeVerifier(), FakeDrafter(), Heard()
    dec = run(verifier, drafter, 0, listener=heard)
    assert dec.tokens == heard.tokens == [] and dec.finish_reason == "length" and dec.stats.cycles == 0
    assert dec.prompt_logprobs == [("scored", t) for t in PROMPT[1:]]
    assert drafter.tokens == [] and not verifier.calls                  # no drafter prefill, no verify
    assert verifier.released == drafter.released == 1


# -- trees cut to what is still wanted -------------------------------------------------------------
def test_trees_never_reach_past_the_tokens_still_wanted():
    verifier, drafter = FakeVerifier(), FakeDrafter(wrong=True)     # one token per cycle
    run(verifier, drafter, 6)
    # after prefill 5 tokens are wanted: depth 3, 3, then 2 (3 left), 1 (2 left), then a root-only cycle
    assert [d["depth"] for d in drafter.drafts] == [3, 3, 2, 1]
    assert verifier.calls[-1][0] is None and len(verifier.calls) == 5


def test_cycle_tree_and_the_budget_share():
    tree = TreeParams(total_tokens=16, depth=6)
    assert cycle_tree(tree, 10) is tree
    assert cycle_tree(tree, 4).depth == 3 and cycle_tree(tree, 1) is None
    assert cycle_tree(tree, 10, share=5).total_tokens == 5 and cycle_tree(tree, 10, share=64) is tree
    assert [shared_tree_tokens(64, s) for s in (0, 1, 2, 64)] == [64, 64, 32, 4]
    drafter = FakeDrafter()
    run(FakeVerifier(sessions=4), drafter, 20, tree=TreeParams(total_tokens=10, depth=6), budget=16)
    assert {d["total"] for d in drafter.drafts} == {4}        # 16 nodes over 4 sessions


# -- the gate and the pending commits ----------------------------------------------------------------
def test_gate_pauses_and_the_pending_commits_arrive_joined():
    verifier, drafter = FakeVerifier(), FakeDrafter(wrong=True, needs_features=True)
    dec = run(verifier, drafter, 21, min_tau=1.5)
    assert dec.tokens == plain(PROMPT, 21)
    # 4 drafted cycles commit 1 token each (< 1.5): 4 root-only cycles, 4 drafted, then 8 paused
    drafted = [tree is not None for tree, _ in verifier.calls]
    assert drafted == [True] * 4 + [False] * 4 + [True] * 4 + [False] * 8
    assert [d["commits"] for d in drafter.drafts] == [0, 1, 1, 1, 5, 1, 1, 1]
    # every draft saw every token committed before it (prompt + first token + one per cycle)
    assert [d["known"] for d in drafter.drafts] == [len(PROMPT) + 1 + i for i in (0, 1, 2, 3, 8, 9, 10, 11)]
    assert all(features for _, features in verifier.calls)          # paused cycles keep the rows coming
    assert dec.gate.paused_cycles == 12


class CuttingVerifier(FakeVerifier):
    """Cuts every drafted tree to its root (a cost sizer where wide verifies cost
    more than they commit): each cycle commits the bonus token alone."""

    async def verify(self, draft, features):
        result = await super().verify(None, features)
        self.calls[-1] = (draft.tree if draft is not None else None, features)
        return Committed(result.tokens, result.accepted, result.features, nodes=1)


def test_trees_cut_to_their_root_pause_the_drafting_they_waste():
    """Drafted trees the verifier keeps cutting to the root count as drafted cycles
    committing one token: the gate pauses drafting as for trees that commit one,
    instead of paying the draft every cycle."""
    verifier, drafter = CuttingVerifier(), FakeDrafter(needs_features=True)
    dec = run(verifier, drafter, 21, min_tau=1.5)
    assert dec.tokens == plain(PROMPT, 21)
    drafted = [tree is not None for tree, _ in verifier.calls]
    assert drafted == [True] * 4 + [False] * 4 + [True] * 4 + [False] * 8
    assert len(drafter.drafts) == 8 and dec.gate.paused_cycles == 12


def test_a_drafter_gone_mid_request_leaves_plain_decoding():
    verifier, drafter = FakeVerifier(), FakeDrafter(needs_features=True, gone_after=2)
    dec = run(verifier, drafter, 30)
    assert dec.tokens == plain(PROMPT, 30)
    assert len(drafter.drafts) == 2
    later = verifier.calls[2:]
    assert later and all(tree is None and not features for tree, features in later)
    assert drafter.released == 1


# -- drafting ahead ------------------------------------------------------------------------------------
def test_trees_drafted_ahead_are_used_and_counted():
    verifier, drafter, heard = FakeVerifier(), FakeDrafter(drafts_ahead=True), Heard()
    dec = run(verifier, drafter, 1 + 4 * 6, lookahead=2, listener=heard)
    assert dec.tokens == plain(PROMPT, 25)
    assert len(drafter.drafts) == 1                             # only the first cycle drafted plainly
    assert dec.stats.ahead_hits == dec.stats.cycles - 1 == 5
    assert dec.stats.ahead_committed == sum(dec.stats.committed_per_cycle[1:])   # every cycle but the first
    assert heard.ahead == [True] * 5
    assert [a["tokens_left"] for a in drafter.aheads] == [24, 20, 16, 12, 8, 4]
    assert [a["commits"] for a in drafter.aheads] == [0] + [1] * 5
    assert all(a["count"] == 2 for a in drafter.aheads)


def test_misses_are_counted_and_sampled_sessions_never_look_ahead():
    drafter, heard = FakeDrafter(wrong=True, drafts_ahead=True), Heard()
    dec = run(FakeVerifier(), drafter, 12, lookahead=1, listener=heard)
    assert dec.stats.ahead_hits == 0 and heard.ahead and not any(heard.ahead)
    assert dec.stats.ahead_committed == 0
    drafter = FakeDrafter(drafts_ahead=True)
    dec = run(FakeVerifier(), drafter, 12, lookahead=1, sampling=SamplingParams(temperature=0.8, seed=1))
    assert drafter.aheads == [] and dec.stats.ahead_hits == 0
    drafter = FakeDrafter(drafts_ahead=False)
    run(FakeVerifier(), drafter, 12, lookahead=1)
    assert drafter.aheads == []


# -- time split ---------------------------------------------------------------------------------------
def test_time_split_books_transport_as_network_and_adds_up():
    verifier = FakeVerifier(network_per_call=0.002)
    dec = run(verifier, FakeDrafter(wrong=True), 8)
    t = dec.stats.time_s
    assert t["network"] == pytest.approx(0.002 * len(verifier.calls))
    assert t["verify"] >= 0.002 * len(verifier.calls) * 0.9
    assert all(v >= 0 for v in t.values()) and sum(t.values()) <= dec.stats.wall_s
    assert overlap((0.0, 2.0), (1.0, 3.0)) == 1.0 and overlap((0.0, 1.0), (2.0, 3.0)) == 0.0


# -- release on every exit path --------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["verify", "drafter prefill"])
def test_an_exception_releases_both_sessions(where):
    verifier = FakeVerifier(fail_on=3 if where == "verify" else 0)
    drafter = FakeDrafter(fail_prefill=where == "drafter prefill")
    with pytest.raises(RuntimeError, match="broke"):
        run(verifier, drafter, 30)
    assert verifier.released == drafter.released == 1


def test_cancellation_releases_both_sessions():
    verifier, drafter = FakeVerifier(hang_on=2), FakeDrafter(drafts_ahead=True)

    async def cancel_while_verifying():
        request = Request(PROMPT, GREEDY, TreeParams(method="chain", total_tokens=4, depth=3), lookahead=2)
        task = asyncio.ensure_future(speculative_generate(verifier, drafter, request,
                                                          Decoding(StopCriteria(max_new_tokens=30))))
        await verifier.hanging.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_while_verifying())
    assert verifier.released == drafter.released == 1


def test_the_loop_imports_no_torch():
    code = "import sys, specdec.request.speculative; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
