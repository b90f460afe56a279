"""``specdec bench --json-schema FILE``: speculation under a JSON Schema, against none.

In-process, on the same prompts and models, for each prompt: one greedy
EAGLE-2 run without a constraint and one with the schema, plus the schema's
plain (vanilla) run, whose tokens the speculative one must equal. Reports:

- τ (tokens per draft/verify cycle, bonus included) constrained and
  unconstrained, and their ratio;
- how many constrained outputs are complete (ended by the grammar, not by
  ``max_new_tokens``), parse as JSON and validate against the schema (with
  ``jsonschema`` when it is installed; else parse only, and the record says so);
- how many equal the plain constrained run token for token;
- the grammar's own time: seconds spent on per-node masks (the verifier's
  tree walks and the drafter's masked levels, ``specdec.tree.grammar.GRAMMAR_TIME``)
  per committed token and per mask, and its share of the constrained wall time.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from specdec.local import DrafterChoice, build_local, generate
from specdec.model.loading import ModelSpec
from specdec.model.prompts import prompt_ids
from specdec.request.constraints import Constraint
from specdec.request.decoding import StopCriteria
from specdec.request.params import SamplingParams, TreeParams
from specdec.tree.grammar import GRAMMAR_TIME


def _validator(schema: dict) -> tuple[Callable[[object], bool], str]:
    try:
        import jsonschema
    except ImportError:
        return (lambda value: True), "parse only (jsonschema not installed)"
    check = jsonschema.validators.validator_for(schema)(schema)
    return check.is_valid, "jsonschema"


def run_structured(target: str, eagle: str, prompts: list, schema_text: str, max_new_tokens: int,
                   tree: TreeParams, progress: Callable[[str], None] | None = None) -> dict:
    constraint = Constraint("json_schema", schema_text).validate("--json-schema")
    valid, validated_by = _validator(json.loads(schema_text))
    stack = build_local(ModelSpec(target), DrafterChoice("eagle", eagle))
    tok = stack.tokenizer
    stop = StopCriteria(max_new_tokens=max_new_tokens, eos_ids=frozenset({tok.eos_token_id}))
    plain_params, constrained = SamplingParams(), SamplingParams(constraint=constraint)
    rows = []
    grammar_s = wall_s = 0.0
    masks = committed = 0
    for i, prompt in enumerate(prompts):
        ids = prompt_ids(tok, prompt)
        free = generate(stack.verifier, stack.drafter, ids, plain_params, stop, tree)
        reference = generate(stack.verifier, None, ids, constrained, stop, None)
        before, masks_before, start = GRAMMAR_TIME.seconds, GRAMMAR_TIME.masks, time.perf_counter()
        spec = generate(stack.verifier, stack.drafter, ids, constrained, stop, tree)
        wall_s += time.perf_counter() - start
        grammar_s += GRAMMAR_TIME.seconds - before
        masks += GRAMMAR_TIME.masks - masks_before
        committed += len(spec.tokens)
        text = tok.decode(spec.tokens, skip_special_tokens=True)
        try:
            ok = spec.finish_reason == "eos" and valid(json.loads(text))
        except ValueError:
            ok = False
        rows.append({"tau_unconstrained": round(free.stats.tau, 4), "tau_constrained": round(spec.stats.tau, 4),
                     "valid": ok, "equals_plain": spec.tokens == reference.tokens, "tokens": len(spec.tokens),
                     "text": text})
        if progress is not None:
            progress(f"prompt {i + 1}/{len(prompts)}: tau {free.stats.tau:.2f} -> {spec.stats.tau:.2f}, "
                     f"{'valid' if ok else 'INVALID'}")
    tau_free = sum(r["tau_unconstrained"] for r in rows) / len(rows)
    tau_con = sum(r["tau_constrained"] for r in rows) / len(rows)
    return {"target": _shown_path(target), "eagle": _shown_path(eagle), "tree": {"method": tree.method, "total_tokens": tree.total_tokens,
                                                       "depth": tree.depth, "expand_k": tree.expand_k},
            "prompts": len(rows), "max_new_tokens": max_new_tokens, "validated_by": validated_by,
            "tau_unconstrained": round(tau_free, 4), "tau_constrained": round(tau_con, 4),
            "tau_ratio": round(tau_con / tau_free, 4), "valid": sum(r["valid"] for r in rows),
            "equal_to_plain": sum(r["equals_plain"] for r in rows),
            "grammar_ms_per_token": round(1e3 * grammar_s / max(committed, 1), 4),
            "grammar_us_per_mask": round(1e6 * grammar_s / max(masks, 1), 2),
            "grammar_share_of_wall": round(grammar_s / max(wall_s, 1e-9), 4), "runs": rows}


def _shown_path(path: str) -> str:
    """``path`` relative to the working directory when inside it (a record that travels)."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def structured_markdown(result: dict) -> str:
    n = result["prompts"]
    return "\n".join([
        "| prompts | τ unconstrained | τ with the schema | ratio | valid | = plain constrained | grammar ms/token "
        "| grammar µs/mask | grammar share of wall |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {n} | {result['tau_unconstrained']:.2f} | {result['tau_constrained']:.2f} | {result['tau_ratio']:.2f} "
        f"| {result['valid']}/{n} | {result['equal_to_plain']}/{n} | {result['grammar_ms_per_token']:.3f} "
        f"| {result['grammar_us_per_mask']:.1f} | {100 * result['grammar_share_of_wall']:.1f}% |",
        f"\n(valid: {result['validated_by']}; greedy, {result['tree']['method']} "
        f"{result['tree']['total_tokens']} nodes, depth {result['tree']['depth']})"])
