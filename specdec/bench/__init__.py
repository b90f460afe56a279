"""``specdec bench``: speculative decoding measured the way the EAGLE-2 paper
does it (speedup and average acceptance length tau, Tables 1-3; Figures 1/2,
5 and 6), against the project's own baselines and the peers a user would pick
instead, all in one process on the same machine.

- ``runner``: methods, the interleaved schedule, measurement and the JSON record;
- ``peers``: transformers' own generate (plain, assisted, prompt lookup);
- ``llamacpp_peer``: llama.cpp on a GGUF export of the same weights (opt-in methods);
- ``profile``: ``specdec bench profile``, where a step's time goes (eager and compiled);
- ``cycle_profile``: ``specdec bench profile --cycle``, host syncs, eager operators and replays per cycle;
- ``services``: the same methods through the gRPC services (``--grpc``);
- ``calibration``: draft confidence vs acceptance (Figure 6);
- ``report``: markdown table and PNG plots;
- ``sweep``: tau and tokens/s over the tree size and depth;
- ``prompts.jsonl``: the benchmark's own Python code prompts.

JSON record of a run::

    {"device": str, "target": str, "temperature": float, "prompts": int, "max_new_tokens": int,
     "methods": {NAME: {"tokens_per_s": float, "speedup_vs_vanilla": float, "speedup_vs_hf_generate": float,
                        "tau": float | null, "accepted_per_position": [float], "matches_vanilla": bool | null,
                        "time_split": {"draft_s", "verify_s", "network_s", "other_s", "wall_s",
                                       "draft_frac", "verify_frac", "network_frac", "other_frac",
                                       "per_cycle_ms": {"draft", "verify", "network", "other", "wall"}},
                        METHOD@grpc*: "wire_bytes_per_cycle": float,
                        METHOD@grpc-aheadN: "ahead_hit_rate": float, "ahead_draft_ms_per_cycle": float,
                        "ahead_tau_hit": float, "ahead_tau_fresh": float (τ of the cycles whose
                        tree was / was not drafted ahead)}},
     "pinned": bool,
     "tree_sizing": {"mode": "fixed" | "cost", "compared": bool,
                     with cost: "verify_ms": {width: ms}, "tokens_per_s": float (specdec.tree.sizing)},
     ...extra keys: tree, models, repeats, generated_tokens, peers, notes, calibration}

tau counts the bonus token; accepted_per_position[j] is the fraction of cycles
that accepted at least j+1 draft tokens; matches_vanilla is null at T > 0;
time-split entries are null where a method does not expose them (HF peers);
per_cycle_ms only for methods with cycles. ``--pin`` runs the services'
verifier and drafter on one core each and the in-process methods on the
verifier's core (one torch thread each); ``--compare-unary`` adds
METHOD@grpc-unary, through an orchestrator without session streams;
``--compare-tree-sizing`` adds each in-process speculative method under the
other tree sizing, as METHOD@fixed or METHOD@cost.

May import: the services, ``specdec.local``, ``specdec.procs``, the SDK and
the core packages. Never the CLI or training.
"""
