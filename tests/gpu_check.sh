#!/usr/bin/env bash
# The GPU check, one script for a device lease (docs/benchmarks.md):
#   1. `specdec bench profile --cycle` eager on the device: host syncs, eager operators and
#      replays per cycle, with the device's synchronising calls and launches (fast: no compiling);
#   2. `specdec bench --device cuda --compile on` for vanilla and eagle2 (compiles cold: minutes);
#   3. the same cycle counts on the compiled path (the inductor cache of step 2 is warm);
#   4. the same, sampled with penalties: trees of drawn proposals drafted and walked on the device
#      (specdec/tree/drawn.py), their eager operators counted as the device's launches;
#   5. the `cuda` tests (compiled forwards on CUDA graphs, the cycle instrument on CUDA).
# Each step has its own time limit (seconds: COUNT_S, BENCH_S, COMPILED_S, SAMPLED_S, TESTS_S; 590
# in all by default) and writes to $OUT (default gpu-check/) as it goes, so a step that runs out of
# time leaves the ones before it. A cold compile of the demo target with eagle2 and eagle3
# took longer than 280 s on an H100: METHODS adds eagle3 where the lease allows.
# PYTHON: an interpreter with a CUDA torch and the project's dependencies (default python3).
set -u
OUT=${OUT:-gpu-check}
PYTHON=${PYTHON:-python3}
METHODS=${METHODS:-vanilla,eagle2}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SPECDEC_COMPILE_AHEAD=${SPECDEC_COMPILE_AHEAD:-ready}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/specdec-inductor}
SPECDEC="$PYTHON -m specdec.cli.main"
step() { echo "== $1 ($(date +%T))"; }

nvidia-smi -L
"$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

step "cycle counts, eager"
timeout "${COUNT_S:-60}" $SPECDEC bench profile --cycle --device cuda --methods "$METHODS" \
    --limit-prompts 2 --max-new-tokens 48 --quiet --json "$OUT/cycle-eager.json" > "$OUT/cycle-eager.md" 2>&1
head -8 "$OUT/cycle-eager.md"

step "bench, compiled"
timeout "${BENCH_S:-300}" $SPECDEC bench --device cuda --compile on --methods "$METHODS" \
    --limit-prompts 4 --max-new-tokens 64 --quiet --json "$OUT/bench-compiled.json" > "$OUT/bench-compiled.md" 2>&1
head -20 "$OUT/bench-compiled.md"

step "cycle counts, compiled"
timeout "${COMPILED_S:-80}" $SPECDEC bench profile --cycle --device cuda --compile on --methods "$METHODS" \
    --limit-prompts 2 --max-new-tokens 48 --quiet --json "$OUT/cycle-compiled.json" > "$OUT/cycle-compiled.md" 2>&1
head -40 "$OUT/cycle-compiled.md"

step "cycle counts, compiled, sampled with penalties"
timeout "${SAMPLED_S:-60}" $SPECDEC bench profile --cycle --device cuda --compile on --methods "$METHODS" \
    --limit-prompts 2 --max-new-tokens 48 --temperature 0.8 --top-p 0.9 --repetition-penalty 1.1 \
    --presence-penalty 0.2 --seed 1 --quiet --json "$OUT/cycle-sampled.json" > "$OUT/cycle-sampled.md" 2>&1
head -40 "$OUT/cycle-sampled.md"

step "cuda tests"
timeout "${TESTS_S:-90}" "$PYTHON" -m pytest -m cuda -q -p no:cacheprovider -n "${WORKERS:-8}" \
    tests/compile/test_compiled_cuda.py tests/bench/test_cycle_profile.py 2>&1 | tee "$OUT/cuda-tests.log" | tail -8
step "done"
