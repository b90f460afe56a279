"""``specdec bench profile --cycle``: the counts are what they name (a planted
read, upload or value-shaped operator in a cycle adds exactly one per call;
nothing inside a compiled step counts, its replay does), they repeat run to
run, they hold at their ceilings for greedy EAGLE cycles (so they cannot
drift back up), and the command's record and errors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from specdec.bench.cycle_profile import count_method
from specdec.bench.runner import LocalMethod
from specdec.cli.main import main
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from drafter.compiled.whole_draft import use_budget
from drafter.eagle.eagle2 import EagleDrafter
from verifier.engine import TargetModel, VerifierEngine

PROMPTS = [[5, 17, 42, 9, 33, 17, 42, 9, 3], [8, 6, 7, 28, 5, 6, 7, 8, 5, 6, 7]]
TREE = TreeParams(total_tokens=12, depth=4)
STOP = StopCriteria(max_new_tokens=16)

# Per greedy cycle on the tiny family (eager, TREE): today's counts, the ceilings a test holds.
# The aims (issue: the cycle on the device) are <= 1 sync and <= 30 eager operators. eagle2 drafts its
# tree on the device (``specdec.tree.ranked``: 39.7 syncs a cycle before, level by level on the host);
# what is left is the eager verify's (the tree read, its mask built on the host, the argmaxes read) and
# the eager head's own uploads. Each level's top-k decides its ties there too (``ranked.top_untied``:
# ten operators more a level than flagging them, 402.93 -> 432.93, where a flagged tie redrafted the tree).
CEILINGS = {"vanilla": {"syncs": 4, "ops": 91}, "eagle2": {"syncs": 10.0, "ops": 432.93}}


# The draft phase of a greedy eagle2 cycle with compiled levels and the whole-draft graph at TREE
# (``drafter.compiled``): the tree's one read, the committed pairs fed and the tree drafted on the device,
# a request's last, shallower trees too: what is left is the tree's one read (cycles past the last draft read none)
COMPILED_DRAFT = {"syncs": 0.93, "ops": 12.07}


@pytest.fixture(scope="module")
def stack(tiny_family):
    verifier = VerifierEngine(TargetModel(ModelSpec(str(tiny_family["target"]))))
    drafter = EagleDrafter(str(tiny_family["eagle"]), str(tiny_family["target"]))
    return verifier, drafter


def method(stack, name: str, params: SamplingParams = SamplingParams()) -> LocalMethod:
    verifier, drafter = stack
    if name == "vanilla":
        return LocalMethod(verifier, None, None, params, STOP)
    return LocalMethod(verifier, drafter, TREE, params, STOP)


@pytest.mark.parametrize("name", ["vanilla", "eagle2"])
def test_counts_repeat_and_hold_their_ceilings(stack, name):
    first = count_method(name, method(stack, name), PROMPTS).record()
    again = count_method(name, method(stack, name), PROMPTS).record()
    assert first == again
    per_cycle = first["per_cycle"]
    assert first["cycles"] > 0 and per_cycle["replays"] == 0          # eager: no compiled steps
    assert per_cycle["syncs"] == pytest.approx(per_cycle["reads"] + per_cycle["uploads"] + per_cycle["shaped"], abs=0.02)
    assert per_cycle["syncs"] <= CEILINGS[name]["syncs"], first["sync_sites"]
    assert per_cycle["ops"] <= CEILINGS[name]["ops"], first["sync_sites"]
    assert "prefill" in first["by_phase"] and "verify" in first["by_phase"]
    if name == "eagle2":
        assert first["by_phase"]["draft"]["ops"] > 0 and first["by_phase"]["draft"]["syncs_per_cycle"] > 0


def test_a_compiled_draft_holds_its_ceiling(stack, tiny_family):
    verifier, _ = stack
    drafter = EagleDrafter(str(tiny_family["eagle"]), str(tiny_family["target"]), compile="on")
    use_budget(drafter, TREE)
    assert drafter.compiled_tree is not None and drafter.compiled_tree.serves(TREE, 0)
    record = count_method("eagle2", LocalMethod(verifier, drafter, TREE, SamplingParams(), STOP), PROMPTS).record()
    draft = record["by_phase"]["draft"]
    assert draft["replays"] > 1, draft                     # the pairs fed and, most cycles, the whole draft
    assert draft["syncs_per_cycle"] <= COMPILED_DRAFT["syncs"], record["sync_sites"]
    assert draft["ops"] <= COMPILED_DRAFT["ops"], record["op_sites"]


def planted(monkeypatch, kind: str):
    """The verifier's verify, with one more ``kind`` in it per call."""
    engine_verify = VerifierEngine.verify

    def verify(self, sid, tree):
        x = torch.arange(4)
        if kind == "reads":
            int(x[1])
        elif kind == "uploads":
            torch.tensor([1, 2], device=x.device)      # host data placed on the model's device
        elif kind == "shaped":
            x[x > 1].sum()
        return engine_verify(self, sid, tree)

    monkeypatch.setattr(VerifierEngine, "verify", verify)


@pytest.mark.parametrize("kind", ["reads", "uploads", "shaped"])
def test_a_planted_sync_counts_once_a_cycle_at_its_site(stack, monkeypatch, kind):
    before = count_method("eagle2", method(stack, "eagle2"), PROMPTS).record()
    planted(monkeypatch, kind)
    after = count_method("eagle2", method(stack, "eagle2"), PROMPTS).record()
    assert after["cycles"] == before["cycles"]
    assert after["per_cycle"][kind] == pytest.approx(before["per_cycle"][kind] + 1, abs=0.011)
    assert after["by_phase"]["verify"][kind] == pytest.approx(before["by_phase"]["verify"][kind] + 1, abs=0.011)
    # the test's code is no project code: the site is the innermost project frame, the loop's verify
    sites = [{(s["kind"], s["site"]): s["per_cycle"] for s in r["sync_sites"]} for r in (before, after)]
    key = (kind, "specdec/local.py:verify")
    assert sites[1][key] == pytest.approx(sites[0].get(key, 0) + 1, abs=0.011)


def test_sampled_cycles_with_penalties_are_counted(stack):
    params = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2, presence_penalty=0.5, seed=3)
    record = count_method("eagle2", method(stack, "eagle2", params), PROMPTS, seed=3).record()
    assert record["cycles"] > 0 and record["per_cycle"]["syncs"] > 0


def test_a_compiled_step_counts_as_one_replay_and_nothing_inside_it(tiny_family):
    eager = VerifierEngine(TargetModel(ModelSpec(str(tiny_family["target"]))))
    fast = VerifierEngine(TargetModel(ModelSpec(str(tiny_family["target"]), compile="on")))
    plain = count_method("vanilla", LocalMethod(eager, None, None, SamplingParams(), STOP), PROMPTS).record()
    compiled = count_method("vanilla", LocalMethod(fast, None, None, SamplingParams(), STOP), PROMPTS).record()
    assert compiled["cycles"] == plain["cycles"]
    assert compiled["per_cycle"]["replays"] == 1                 # the one-token step, each cycle
    # plain decoding on the compiled path: the token read back, and kept on the device for the next step's
    # forward (the root placed there from it: nothing goes up)
    assert compiled["per_cycle"]["reads"] == 1 and compiled["per_cycle"]["syncs"] == 1, compiled["sync_sites"]
    hidden = sum(s["per_cycle"] for s in plain["op_sites"] if s["site"].startswith("specdec/model/causal_lm.py"))
    assert hidden > 50                                           # the layers' operators, eager ...
    assert not any(s["site"].startswith("specdec/model/causal_lm.py") and s["kind"] == "ops"
                   for s in compiled["op_sites"])               # ... and none of them inside the replay


def test_the_command_writes_its_record(tiny_family, tmp_path, capsys):
    out = tmp_path / "cycle.json"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    args = ["bench", "profile", "--cycle", "--target", str(tiny_family["target"]), "--eagle",
            str(tiny_family["eagle"]), "--prompts", str(prompts), "--max-new-tokens", "8", "--methods",
            "vanilla,eagle2", "--total-tokens", "8", "--depth", "3", "--quiet", "--json", str(out)]
    assert main(args) == 0
    record = json.loads(out.read_text())
    assert list(record["methods"]) == ["vanilla", "eagle2"] and record["prompts"] == 1
    for name, r in record["methods"].items():
        assert set(r["per_cycle"]) == {"syncs", "reads", "uploads", "shaped", "ops", "replays"}, name
        assert r["cycles"] > 0 and r["cuda"] is None
    assert "| eagle2 |" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--methods", "hf-generate"], "--cycle counts the in-process methods, not 'hf-generate'"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--repetition-penalty", "0"], "repetition_penalty"),
])
def test_bad_flags_are_one_line(tiny_family, tmp_path, capsys, flags, message):
    args = ["bench", "profile", "--cycle", "--target", str(tiny_family["target"]), "--eagle",
            str(tiny_family["eagle"]), "--json", str(tmp_path / "c.json"), *flags]
    assert main(args) != 0
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.cuda
def test_on_cuda_the_device_side_is_counted_too(tiny_family):
    """On a GPU: the device's synchronising calls and launches per cycle; a compiled
    step replays as one CUDA graph launch."""
    assert torch.cuda.is_available(), "the cuda tests need a CUDA device"
    for compile_mode in ("off", "on"):
        engine = VerifierEngine(TargetModel(ModelSpec(str(tiny_family["target"]), device="cuda",
                                                      compile=compile_mode)))
        record = count_method("vanilla", LocalMethod(engine, None, None, SamplingParams(), STOP), PROMPTS).record()
        cuda = record["cuda"]
        assert cuda is not None and cuda["device_syncs"] >= 1, cuda        # the token read back, at least
        assert cuda["kernel_launches"] > 0, cuda
        if compile_mode == "on":
            assert record["per_cycle"]["replays"] == 1 and cuda.get("graph_launches", 0) >= 1, record


# Per eagle2 cycle on the compiled tiny target (TREE), the drafter eager: the verify phase's counts, held.
# The eager drafter drafts its tree on the device too (``specdec.tree.ranked``), placed there: the draft
# and the argmaxes (sampled: the path and the bonus) come back in one read; the mask, the walk, the
# cache's compaction and the features' gather stay on the device (a request's last, root-only cycles
# place their root and read its token: the 0.07).
VERIFY_CEILING = {True: {"syncs_per_cycle": 1.07, "reads": 1, "uploads": 0.07, "shaped": 0, "ops": 19.33},
                  False: {"syncs_per_cycle": 1.07, "reads": 1, "uploads": 0.07, "shaped": 0, "ops": 66.73}}
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=3)


@pytest.fixture(scope="module")
def compiled_target(tiny_family):
    return VerifierEngine(TargetModel(ModelSpec(str(tiny_family["target"]), compile="on")))


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_a_compiled_verify_reads_once(compiled_target, stack, params):
    """Greedy, and sampled over one-hot proposals (the walk on the device:
    ``specdec.tree.acceptance.sampled_order``, the path and the bonus read)."""
    tree = replace(TREE, proposals="top")
    record = count_method("eagle2", LocalMethod(compiled_target, stack[1], tree, params, STOP), PROMPTS,
                          seed=3).record()
    verify = record["by_phase"]["verify"]
    assert verify["replays"] == 1, verify
    for kind, most in VERIFY_CEILING[params.greedy].items():
        assert verify[kind] <= most, (kind, verify, record["sync_sites"])


# Per cycle, the whole compiled tiny stack (compiled target and drafter, TREE, one-hot proposals): one
# read, of the draft and the verdict together (the tree drafted, placed and verified on the device:
# ``specdec.tree.placed.DeviceTree``); a request's last, root-only cycles place their root (one upload)
# and read its token (sampled: also the walk's; penalised: and commit its counts, one upload); the
# eager operators outside the graphs (the committed tokens reach the drafter on the device).
# Penalties count each node's path on the device.
WHOLE_CYCLE = {"greedy": {"syncs": 1.07, "ops": 26.73}, "sampled": {"syncs": 1.07, "ops": 74.13},
               "penalised": {"syncs": 1.07, "ops": 95.73}}
PENALISED = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2, presence_penalty=0.5, seed=3)


@pytest.mark.parametrize("params, kind", [(SamplingParams(), "greedy"), (SAMPLED, "sampled"),
                                          (PENALISED, "penalised")], ids=["greedy", "sampled", "penalised"])
def test_a_compiled_cycle_holds_its_ceiling(compiled_target, tiny_family, params, kind):
    drafter = EagleDrafter(str(tiny_family["eagle"]), str(tiny_family["target"]), compile="on")
    use_budget(drafter, TREE)
    tree = replace(TREE, proposals="top")
    record = count_method("eagle2", LocalMethod(compiled_target, drafter, tree, params, STOP), PROMPTS,
                          seed=3).record()
    per_cycle = record["per_cycle"]
    assert per_cycle["syncs"] <= WHOLE_CYCLE[kind]["syncs"], record["sync_sites"]
    assert per_cycle["ops"] <= WHOLE_CYCLE[kind]["ops"], record["op_sites"]
    sites = {s["site"] for s in record["sync_sites"]}
    assert "verifier/session.py:settle_unread" in sites and "drafter/compiled/whole_draft.py:draft" not in sites


def test_a_greedy_cycle_feeds_the_drafter_the_tokens_it_left_on_the_device(compiled_target, tiny_family,
                                                                           monkeypatch):
    """In-process, a greedy verify on the device hands the drafter its committed tokens there
    (``VerifyResult.token_ids``): the compiled feed copies them in one operator instead of filling
    each from the host, and feeds exactly what the host's tokens feed (same pairs, same outputs).
    The features a commit hands over are its kept rows alone, not a view of the whole tree's (the
    drafter holds them for the session)."""
    from drafter.compiled.head_levels import CompiledHead
    from specdec.local import LocalDrafter, generate

    feed = CompiledHead.feed

    compact = []

    def run(device_ids: bool):
        fed = []

        def spy(self, cache, tokens, feats, ids=None):
            compact.append(feats.untyped_storage().nbytes() == feats.numel() * feats.element_size())
            out = feed(self, cache, tokens, feats, ids)
            fed.append((list(tokens), ids is not None, None if out is None else out[1].clone()))
            return out

        monkeypatch.setattr(CompiledHead, "feed", spy)
        if not device_ids:
            monkeypatch.setattr(LocalDrafter, "joined_ids", staticmethod(lambda commits: None))
        drafter = EagleDrafter(str(tiny_family["eagle"]), str(tiny_family["target"]), compile="on")
        use_budget(drafter, TREE)
        decoding = generate(compiled_target, drafter, PROMPTS[0], SamplingParams(), STOP,
                            replace(TREE, proposals="top"))
        return decoding.tokens, fed

    tokens, fed = run(device_ids=True)
    host_tokens, host_fed = run(device_ids=False)
    assert tokens == host_tokens
    assert sum(on_device for _, on_device, _ in fed) >= 2 and not any(on_device for _, on_device, _ in host_fed)
    assert [pairs for pairs, _, _ in fed] == [pairs for pairs, _, _ in host_fed]
    for (_, _, got), (_, _, want) in zip(fed, host_fed):
        assert got is not None and want is not None and torch.equal(got, want)
    assert compact and all(compact)


# The same stack drafting sampled proposals (children drawn from the draft's distribution,
# ``specdec.tree.drawn``): the tree drafted, placed and verified on the device with its proposals, one read
# a cycle as above (before it: ~90 host syncs a cycle, the draws shared out and read level by level). The
# eager operators are the draft's bookkeeping on the device (~300: proposals, shares, draws, the next
# level's inputs, the placing) and the walk over the proposals (~170): no graph holds them yet.
DRAWN_CYCLE = {"sampled": {"syncs": 1.09, "ops": 473.3}, "penalised": {"syncs": 1.09, "ops": 494.8}}


@pytest.mark.parametrize("params, kind", [(SAMPLED, "sampled"), (PENALISED, "penalised")],
                         ids=["sampled", "penalised"])
def test_a_compiled_cycle_of_drawn_proposals_holds_its_ceiling(compiled_target, tiny_family, params, kind):
    drafter = EagleDrafter(str(tiny_family["eagle"]), str(tiny_family["target"]), compile="on")
    tree = replace(TREE, proposals="sampled")
    record = count_method("eagle2", LocalMethod(compiled_target, drafter, tree, params, STOP), PROMPTS,
                          seed=3).record()
    per_cycle = record["per_cycle"]
    assert record["by_phase"]["draft"]["syncs_per_cycle"] == 0, record["sync_sites"]
    assert per_cycle["syncs"] <= DRAWN_CYCLE[kind]["syncs"], record["sync_sites"]
    assert per_cycle["ops"] <= DRAWN_CYCLE[kind]["ops"], record["op_sites"]
    sites = {s["site"] for s in record["sync_sites"]}
    assert "verifier/session.py:settle_unread" in sites and "drafter/cached.py:_draft_drawn" not in sites


# A compiled draft LM's chain (sps) and a compiled head's chain on the compiled target: the chain drafted on
# the device (``specdec.tree.ranked``; before: ~15 syncs a level) and verified unread, the draft LM fed its
# commit from the verifier's tokens on the device (the rest: a request's first feed, its last root-only cycles).
CHAIN_CYCLE = {"sps": 1.2, "chain": 1.1}


@pytest.mark.parametrize("name", ["sps", "chain"])
def test_a_chain_drafted_on_the_device_reads_once_a_cycle(compiled_target, stack, tiny_family, name):
    from drafter.draft_lm import DraftLmDrafter

    drafter = DraftLmDrafter(ModelSpec(str(tiny_family["draft-lm"]), compile="on")) if name == "sps" else \
        EagleDrafter(str(tiny_family["eagle"]), str(tiny_family["target"]), compile="on")
    tree = TreeParams(method="chain", total_tokens=6, depth=5, proposals="top")
    record = count_method(name, LocalMethod(compiled_target, drafter, tree, SamplingParams(), STOP), PROMPTS,
                          seed=3).record()
    assert record["by_phase"]["draft"]["syncs_per_cycle"] <= 0.2, record["sync_sites"]
    assert record["per_cycle"]["syncs"] <= CHAIN_CYCLE[name], record["sync_sites"]
