"""``specdec generate --server HOST:PORT``: the same prompts, flags and output as
``--local``, through an orchestrator with the client SDK.

The server decides the models; the model flags of ``generate`` are accepted
and ignored here. Every failure (bad input, unreachable server, a deadline)
is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from specdec.cli.options import print_logprobs, prompt_text, result_record
from specdec.request.errors import UsageError
from specdec.request.params import VANILLA


def add_client_flags(p: argparse.ArgumentParser) -> None:
    """Flags of ``generate`` that only matter with ``--server``."""
    g = p.add_argument_group("server calls (--server)")
    g.add_argument("--token", default=os.environ.get("SPECDEC_TOKEN") or None,
                   help="bearer token of the orchestrator (env SPECDEC_TOKEN)")
    g.add_argument("--tls-ca", default=os.environ.get("SPECDEC_TLS_CA") or None,
                   help="CA bundle (PEM) to call the orchestrator over TLS (env SPECDEC_TLS_CA)")
    g.add_argument("--timeout", type=float, default=None, help="deadline of each request, seconds")


def _request_params(args, params, tree_cfg) -> dict:
    out = dict(max_new_tokens=args.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
               top_k=params.top_k, seed=params.seed, min_p=params.min_p, presence_penalty=params.presence_penalty,
               frequency_penalty=params.frequency_penalty, repetition_penalty=params.repetition_penalty,
               logit_bias=dict(params.logit_bias), logprobs=args.logprobs)
    c = params.constraint
    if c is not None:       # the SDK's keyword of each kind
        out.update({"json_object": True} if c.kind == "json_object" else {c.kind: c.value})
    if tree_cfg is None:
        out["method"] = VANILLA
    else:
        out.update(method=tree_cfg.method, total_tokens=tree_cfg.total_tokens, depth=tree_cfg.depth,
                   expand_k=tree_cfg.expand_k, value_temperature=tree_cfg.value_temperature or 0.0,
                   proposals=tree_cfg.proposals)
    return out


def run_remote(args, prompts: list, params, tree_cfg) -> int:
    """Each prompt through the orchestrator: text as the prompt, a chat as ``messages``
    (rendered there with the server's chat template)."""
    from specdec.client import SpecdecClient, SpecdecClientError     # grpc: only when calling a server

    request = _request_params(args, params, tree_cfg)
    tls = getattr(args, "tls_ca", None)
    with SpecdecClient(args.server, token=getattr(args, "token", None), tls=tls,
                       timeout=getattr(args, "timeout", None)) as client:
        for prompt in prompts:
            if not prompt:
                raise UsageError("prompt must not be empty")
            text, messages = (prompt, None) if isinstance(prompt, str) else (None, prompt)
            asked = dict(request, messages=messages) if messages else request
            try:
                if args.json:
                    result = client.complete(text, **asked)
                    logprobs = None if args.logprobs is None else result.logprobs
                    print(json.dumps(result_record(result.token_ids, result.text, result.stats, logprobs)),
                          flush=True)
                    continue
                stream = client.generate(text, **asked)
                sys.stdout.write(prompt_text(prompt))
                for chunk in stream:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                print(flush=True)
                if args.logprobs is not None:
                    print_logprobs(stream.logprobs)
            except SpecdecClientError as exc:
                raise UsageError(f"{args.server}: {exc}") from None
            s = stream.stats
            print(f"[{s.completion_tokens} tokens, {s.cycles} cycles, tau {s.tau:.2f}, {s.tokens_per_s:.1f} tok/s]",
                  file=sys.stderr)
    return 0
