# Two commands do all the set-up on a fresh machine; both create (or reuse) the virtual environment .venv.
#   make demo   train the embedded default job end to end (offline, CPU, about a minute)
#   make test   run the whole test suite (offline, CPU)
# TORCH_SPEC picks the torch wheel: the pinned version is the CPU build served locally here; on a GPU machine
# pip resolves the same pin to its CUDA build, or override it: make test TORCH_SPEC="torch>=2.4".

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.trl_ppo-installed

.PHONY: demo test install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/trl-ppo $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) trl_ppo_default_run
