PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := token

.PHONY: setup setup-cupy bench test lint docs clean gpu-check gpu-dry-run

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# The real cupy and NCCL (CUDA 12 wheels; they import without a GPU), for the API-level GPU tests
# that tests/gpu/test_cupy_api.py runs against them. CI installs them; on a machine without a GPU
# the other GPU tests still run on the CPU stand-in (tests/gpu/standin).
setup-cupy: $(STAMP)
	$(BIN)/pip install -q -c constraints.txt cupy-cuda12x==14.2.0 nvidia-nccl-cu12==2.32.3

bench: $(STAMP)
	$(BIN)/python -m bench $(ARGS)
	$(BIN)/python -m bench weights $(filter --quick,$(ARGS))

test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

# Formatting, lint, types (topology/, reshard/, scheduler/, runtime included: [tool.mypy]), import layers
# ([tool.importlinter]).
lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-logo

# The API reference and guides (mkdocs.yml, docs/) into site/; a warning fails it.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --quiet

# The ordered first checks on a GPU machine (tests/gpu/check.py), stopping at the first failure; logs in
# gpu-check/. GPU_PYTHON: an interpreter with torch, cupy and ray (default: the project's virtualenv).
GPU_PYTHON ?= $(BIN)/python
gpu-check:
	RESHARD_REQUIRE_GPUS=1 $(GPU_PYTHON) tests/gpu/check.py $(ARGS)

# The GPU bench's one prepared script (python -m bench gpu) on the CPU stand-in: every reshard it makes
# checked, nothing measured (CI runs it, so that a lent GPU's few minutes never meet a broken script).
gpu-dry-run: $(STAMP)
	PYTHONPATH=tests/gpu/standin $(BIN)/python -m bench gpu --dry-run

# The virtualenv, tool caches and scratch bench output; tracked files (the quoted bench results) stay.
clean:
	rm -rf $(VENV) site .mypy_cache .import_linter_cache .ruff_cache .pytest_cache
	git clean -fdX -- bench/results
