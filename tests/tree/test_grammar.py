"""Per-node grammar masks: each node's row is the mask a fresh matcher gives
after that node's own path (the walk leaves the committed matcher where it
was); drafters' masked log-probs renormalise over the allowed tokens."""

import json
import math

import llguidance
import pytest
import torch

from specdec.model.loading import default_grammar_tokenizer
from specdec.request.constraints import Constraint
from specdec.tree.build import Frontier
from specdec.tree.grammar import GrammarState, masked_expand, token_mask

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
          "required": ["ok", "color"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(tiny_family):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_family["target"]), default_grammar_tokenizer(None, tiny_family["target"])


def ids(hf, text: str) -> list[int]:
    return hf(text)["input_ids"]


def fresh_mask(grammar_tok, constraint, tokens: list[int], vocab: int) -> torch.Tensor:
    matcher = llguidance.LLMatcher(grammar_tok, constraint.grammar())
    assert matcher.consume_tokens(tokens) or not tokens
    return token_mask(matcher, vocab)


def test_each_node_gets_its_own_paths_mask(tokenizer):
    hf, grammar_tok = tokenizer
    vocab = len(hf)
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    committed = ids(hf, '{"ok": ')
    state = GrammarState(grammar_tok, constraint, vocab, [5, 6] + committed, prompt_len=2)
    # a tree under the last committed token, with branches the grammar refuses
    t, f, r = ids(hf, "true")[0], ids(hf, "false")[0], ids(hf, "red")[0]
    comma, tail = ids(hf, ",")[0], ids(hf, "rue")
    tokens = [committed[-1], t, f, r, comma, tail[0], comma]
    parents = [-1, 0, 0, 0, 1, 1, 5]
    masks = state.node_masks(tokens, parents)
    checked = refused = 0
    for node in range(len(tokens)):
        path, a = [], node
        while a > 0:
            path.insert(0, tokens[a])
            a = parents[a]
        matcher = llguidance.LLMatcher(grammar_tok, constraint.grammar(), log_level=0)
        if matcher.validate_tokens(committed + path) < len(committed + path):
            # refused on the way: probability 0 at its parent, its own row unmasked
            assert not bool(masks[parents[node], tokens[node]]) or bool(masks[node].all())
            refused += 1
            continue
        assert torch.equal(masks[node], fresh_mask(grammar_tok, constraint, committed + path, vocab)), node
        checked += 1
    assert checked >= 3 and refused >= 1
    prefix = committed
    # the walk rolled back: the committed state's mask is unchanged
    assert torch.equal(state.mask(), fresh_mask(grammar_tok, constraint, prefix, vocab))
    assert state.matcher.validate_tokens([t]) == 1


def test_truncate_rolls_back_to_a_committed_length(tokenizer):
    hf, grammar_tok = tokenizer
    constraint = Constraint("regex", "(ab|ba)+")
    a, b = ids(hf, "a")[0], ids(hf, "b")[0]
    state = GrammarState(grammar_tok, constraint, len(hf), [7], prompt_len=1)
    state.commit([a, b, b])
    state.truncate(3)                       # prompt + "ab"
    assert torch.equal(state.mask(), fresh_mask(grammar_tok, constraint, [a, b], len(hf)))


def test_masked_expand_renormalises_over_allowed_tokens(tokenizer):
    hf, grammar_tok = tokenizer
    vocab = len(hf)
    state = GrammarState(grammar_tok, Constraint("regex", "(x|y)z"), vocab)
    x, z = ids(hf, "x")[0], ids(hf, "z")[0]
    logp = torch.log_softmax(torch.randn(2, vocab, generator=torch.Generator().manual_seed(0)), -1)

    def expand(frontier):
        return logp[:frontier.nodes.numel()]

    masked = masked_expand(expand, state)
    root = masked(Frontier(torch.tensor([0]), torch.tensor([7]), torch.tensor([-1]), 0))
    allowed = fresh_mask(grammar_tok, state.constraint, [], vocab)
    assert torch.isclose(root[0].exp().sum(), torch.tensor(1.0))
    assert bool(torch.isinf(root[0][~allowed]).all()) and bool(torch.isfinite(root[0][allowed]).all())
    child = masked(Frontier(torch.tensor([1]), torch.tensor([x]), torch.tensor([0]), 1))
    assert torch.isclose(child[0, z].exp(), torch.tensor(1.0))         # after "x" only "z" (single-char tokens)
    # a drafter whose support the grammar refuses whole (EAGLE-3's reduced vocabulary):
    # uniform over the allowed tokens, so a forced token is still drafted
    narrow = torch.full((1, vocab), -math.inf)
    narrow[0, ids(hf, "q")[0]] = 0.0
    frontier = Frontier(torch.tensor([0, 1]), torch.tensor([7, x]), torch.tensor([-1, 0]), 1)
    state_paths = masked_expand(lambda f: narrow.expand(2, -1), state)
    state_paths(Frontier(torch.tensor([0]), torch.tensor([7]), torch.tensor([-1]), 0))
    rows = state_paths(frontier)
    assert torch.allclose(rows[0][allowed].exp(), torch.full((int(allowed.sum()),), 1 / int(allowed.sum())))
    assert torch.isclose(rows[1, z].exp(), torch.tensor(1.0))          # the forced "z"
