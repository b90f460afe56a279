"""Sampling with Hydra heads is lossless: at T = 1 with penalties the
committed tokens follow the exact penalised target joint (chi-square against
the enumerated joint, the Medusa test's setup), for the dynamic tree with
sampled proposals and the static tree with top (one-hot) proposals, for
"mlp" heads and Hydra++ "prefix-mlp" ones (the prefix layer's KV cache
following each session's commits). Hydra's
proposals depend on the path, so each node must ship the distribution its
own children were drawn from: a planted drafter that draws a node's
children from its own path but ships the q of a sibling path (the Medusa
shortcut: one distribution per level) is caught by the same check."""

from dataclasses import replace

import pytest
import torch

from drafter.hydra import HydraDrafter
from drafter.hydra_heads import HydraHeads
from specdec.local import generate
from specdec.model.loading import ModelSpec
from specdec.request.decoding import StopCriteria
from specdec.request.params import TreeParams
from specdec.tree.proposals import Proposal
from verifier.engine import TargetModel, VerifierEngine
from specdec.tree.sampling import History, target_probs
from test_medusa_lossless import PENALISED, PROMPT, V, chi2_pvalue
from stats import chi2_runs

# four new tokens: the prefill's bonus, then a tree whose depth-2 nodes (head 1, the
# path-dependent one) can still be accepted within the budget
HIDDEN, NEW, RUNS = 32, 4, chi2_runs(600)


def exact_joint(model, params) -> torch.Tensor:
    """P(t1..t4 | PROMPT) under the penalised target, [V] * NEW."""
    joint, seqs = torch.ones(()), [list(PROMPT)]
    for _ in range(NEW):
        with torch.no_grad():
            logits = model(torch.tensor(seqs)).logits[:, -1]
        rows = [target_probs(row, params, History(V, seq, len(PROMPT)).counts()) for seq, row in zip(seqs, logits)]
        joint = (joint.reshape(-1, 1) * torch.stack(rows)).reshape(-1)
        seqs = [seq + [t] for seq in seqs for t in range(V)]
    return joint.reshape([V] * NEW)


def heads_for(target, arch: str = "mlp") -> HydraHeads:
    """Two heads fitted to the penalty-free target's own samples (teacher
    forced, a few hundred full-batch steps): partly right, and head 1's
    distribution depends on the path; "prefix-mlp": with a prefix layer shaped
    like the target's decoder layer, trained with them."""
    from drafter.hydra_prefix import prefix_config
    from specdec.train.hydra import hydra_losses

    torch.manual_seed(8)
    with torch.no_grad():
        seqs = torch.tensor([PROMPT] * 256)
        for _ in range(NEW + 1):
            probs = torch.softmax(target(seqs).logits[:, -1].float(), -1)
            seqs = torch.cat([seqs, torch.multinomial(probs, 1)], dim=1)
        feats = target.model(seqs).last_hidden_state.float()
    embed = target.get_input_embeddings().weight.detach().float()
    labels = torch.cat([seqs[:, 1:], seqs[:, -1:]], dim=1)       # the token that followed each position
    heads = HydraHeads(HIDDEN, V, num_heads=2, prefix=prefix_config(target.config) if arch == "prefix-mlp" else None)
    opt = torch.optim.Adam(heads.parameters(), lr=3e-2)
    for _ in range(150):
        loss, _ = hydra_losses(heads, embed, seqs[:, :-1], feats[:, :-1], labels[:, :-1])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.eval()


class SiblingQDrafter(HydraDrafter):
    """Broken on purpose: below the root every node ships, for the children
    it drew from its own path, the probabilities head d gives another path
    of its level (its path with its last token shifted by two)."""

    shift = 2

    def draft_session(self, sess, cfg):
        tree = super().draft_session(sess, cfg)
        if not tree.proposals:
            return tree
        toks, parents = tree.tokens.tolist(), tree.parents.tolist()

        def path(node):
            return path(parents[node]) + [toks[node]] if node >= 0 else []

        shipped = {}
        for node, prop in tree.proposals.items():
            route = path(node)
            if len(route) > 1:
                route[-1] = (route[-1] + self.shift) % V
                q = self.head_logprobs(len(route) - 1, sess.features[-1], torch.tensor([route]))[0].exp()
                probs = q[prop.tokens]
                prop = Proposal(prop.tokens, (probs / probs.sum()).float())
            shipped[node] = prop
        return replace(tree, proposals=shipped)


@pytest.fixture(scope="module")
def engines():
    from tiny import tiny_llama

    target = tiny_llama(V, seed=5, hidden=HIDDEN)
    for p in target.parameters():
        p.data.mul_(3.0)
    heads = {arch: heads_for(target, arch) for arch in ("mlp", "prefix-mlp")}
    embed = target.get_input_embeddings().weight.detach()
    verifier = VerifierEngine(TargetModel(ModelSpec("unused"), model=target))
    return target, verifier, heads, embed


def sampled_joint(verifier, drafter, method: str, proposals: str) -> tuple[torch.Tensor, float]:
    counts = torch.zeros([V] * NEW)
    cfg = TreeParams(method=method, total_tokens=6, depth=2, expand_k=2, proposals=proposals)
    stop, accepted = StopCriteria(max_new_tokens=NEW), 0
    for seed in range(RUNS):
        done = generate(verifier, drafter, PROMPT, replace(PENALISED, seed=seed), stop, cfg)
        counts[tuple(done.tokens)] += 1
        accepted += done.stats.accepted
    return counts, accepted / RUNS


@pytest.mark.parametrize("arch", ["mlp", "prefix-mlp"])
@pytest.mark.parametrize("method,proposals", [("eagle2", "sampled"), ("static", "top")],
                         ids=["hydra-sampled", "hydra-static-top"])
def test_hydra_sampling_matches_the_penalised_target(engines, method, proposals, arch):
    target, verifier, heads, embed = engines
    drafter = HydraDrafter("unused", heads=heads[arch], embed=embed)
    counts, accepted = sampled_joint(verifier, drafter, method, proposals)
    assert accepted > 0.3
    assert chi2_pvalue(counts, exact_joint(target, PENALISED)) > 1e-4


def test_shipping_another_paths_q_is_caught(engines):
    target, verifier, heads, embed = engines
    counts, _ = sampled_joint(verifier, SiblingQDrafter("unused", heads=heads["mlp"], embed=embed), "eagle2", "sampled")
    assert chi2_pvalue(counts, exact_joint(target, PENALISED)) < 1e-4
