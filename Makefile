PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled

.PHONY: setup bench test lint clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

bench: $(STAMP)
	$(BIN)/python -m bench $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) bench/results
