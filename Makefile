# Two commands for a newcomer:  `make demo` (the main job)  and  `make test` (the test suite).
# Both create or reuse the virtual environment in .venv, so they work on a fresh clone.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch first, pinned: on the course machines 2.13.0 is a local CPU build (no CUDA download),
# and installing it before avrid means the project's own `torch>=2.11` is already satisfied.
TORCH  ?= torch==2.13.0
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED ?= 0

.PHONY: setup demo test lint gpu-test bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

setup: $(BIN)/.installed  ## create .venv and install avrid with its dev tools

demo: setup  ## the main job: `avrid ppo` (PPO on CPU, a few minutes)
	$(BIN)/avrid ppo

lint: setup  ## style and the layer import contract
	$(BIN)/ruff check avrid chapters tests benchmarks
	$(BIN)/lint-imports

test: lint  ## the CPU test suite (gpu/vllm tests skip themselves here)
	$(BIN)/python -m pytest

gpu-test: setup  ## only the GPU tier, on a CUDA machine
	$(BIN)/python -m pytest -m "gpu or vllm" -v

bench: setup  ## the benchmarks (they print ratios; not timed tests)
	for b in benchmarks/bench_*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis .import_linter_cache
