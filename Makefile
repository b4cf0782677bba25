# Two entry points for a fresh machine: `make train` (the main job) and `make test`.
# Both create the virtual environment first when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: train test lint env

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU build from the registry; a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

env: $(STAMP)

train: $(STAMP)
	$(BIN)/graphswap train $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check graphswap passes tests tools
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check graphswap passes tests tools
