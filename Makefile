# Two entry points for a fresh machine: `make train` (the main job) and `make test`.
# Both create the virtual environment first when it is missing. `make ci` is what CI runs
# (.ci/run runs the same targets, the slow installs in the background).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed

# The GPU machine's image, as far as a CPU machine can have it: torch 2.11 (the registry's
# CUDA 13 build, which runs on CPU), transformers 5.17, networkx, pytest, hypothesis, pyyaml
# and tqdm; no pydot, no matplotlib, no ruff.
DEVICE_VENV := .venv-device
DEVICE_PACKAGES := torch==2.11.0 transformers==5.17.0 networkx pytest hypothesis pyyaml tqdm
# The oldest versions pyproject.toml claims, and the test tools the whole suite needs.
FLOOR_VENV := .venv-floor
FLOOR_PACKAGES := torch==2.9.0 transformers==5.4.0 networkx==3.0 pyyaml==6.0 tqdm==4.60.0 \
	pytest hypothesis pydot matplotlib accelerate import-linter
# The tests of the code that calls torch or transformers: the runtime, the rewrite, the
# planner's trace, the Hugging Face builders, the families, the loading of 0.1.0's pickles
# (torch.load). CI runs them on the GPU
# image's package set (no pydot) and, with the pass tests (FSDP2 and DTensor on gloo), on
# the oldest versions pyproject.toml claims.
COMPAT_TESTS := tests/graphswap/runtime tests/graphswap/train/test_build.py \
	tests/graphswap/hf/test_checkpoints.py tests/graphswap/hf/test_families.py \
	tests/graphswap/hf/test_qwen3_moe.py \
	tests/graphswap/rewriting/test_transforms.py tests/graphswap/rewriting/test_apply.py \
	tests/graphswap/rewriting/test_rules.py tests/graphswap/planning/test_planner.py \
	tests/graphswap/planning/test_measure.py tests/passes/test_infrastructure.py \
	tests/graphswap/_compat/test_old_pickles.py
FLOOR_TESTS := $(COMPAT_TESTS) tests/passes
# No network for the dry run where this machine allows a private network namespace.
NO_NETWORK := $(shell unshare -n true 2>/dev/null && echo unshare -n)

.PHONY: train test lint env docs ci device-dry-run compat compat-device compat-floor

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU build from the registry; a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

# -qq: errors only. At -q every install here also prints setuptools' deprecation of
# pyproject's license table and pip's notes on this machine's index settings, neither of
# which is about the docs.
$(DOCS_STAMP): $(STAMP)
	$(BIN)/pip install -qq -e ".[docs]"
	touch $(DOCS_STAMP)

$(DEVICE_VENV)/.installed: Makefile
	rm -rf $(DEVICE_VENV)
	$(PY) -m venv $(DEVICE_VENV)
	$(DEVICE_VENV)/bin/pip install --quiet --no-compile $(DEVICE_PACKAGES)
	touch $@

$(FLOOR_VENV)/.installed: Makefile
	rm -rf $(FLOOR_VENV)
	$(PY) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/pip install --quiet --no-compile $(FLOOR_PACKAGES)
	touch $@

env: $(STAMP)

train: $(STAMP)
	$(BIN)/graphswap train $(ARGS)

# Two workers (pytest-xdist), a test file each at a time: most tests compute on one thread
# and the gloo worlds wait on their ranks, so one process left a core idle; --durations=15:
# every run lists the slowest tests (the suite must stay under 3 minutes).
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15 $(PYTEST_ARGS)

# ruff, the layers contract in pyproject.toml (imports point down: application ->
# passes -> core), and mypy over the packages `[tool.mypy]` lists (strict: the runtime).
lint: $(STAMP)
	$(BIN)/ruff check graphswap passes tests tools docs/hooks
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy

# The documentation site in site/ (mkdocs.yml). --strict: a warning (a broken link or
# anchor, a name an API page cites that no longer exists) fails the build.
# NO_MKDOCS_2_WARNING silences mkdocs-material's notice about its own end of life, which
# is printed on every build and is no warning about these pages.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# tools/device_check.sh --dry-run where the GPU check will run: the image's packages only,
# no package index, no network. A dependency the image lacks fails here.
device-dry-run: $(DEVICE_VENV)/.installed
	@if $(DEVICE_VENV)/bin/python -c "import pydot" 2>/dev/null; then \
		echo "error: $(DEVICE_VENV) has pydot, which the GPU image lacks"; exit 1; fi
	@echo "$(DEVICE_VENV): no pydot; network: $(or $(NO_NETWORK),not isolated (unshare -n refused))"
	PIP_NO_INDEX=1 PYTHON=$(DEVICE_VENV)/bin/python $(NO_NETWORK) \
		tools/device_check.sh out/device-dry-run --dry-run

# COMPAT_TESTS on the GPU image's torch and transformers; FLOOR_TESTS on the oldest versions
# claimed. The rest of the suite (the commands, the trainer's loop and config, the planner's
# arithmetic, the tools) calls those libraries only through the code these tests cover.
# Split in two so that CI can hold one of the two CUDA-build environments on disk at a time.
compat: compat-device compat-floor

compat-device: $(DEVICE_VENV)/.installed
	$(DEVICE_VENV)/bin/python -c "import torch, transformers; \
		print('$(DEVICE_VENV): torch', torch.__version__, 'transformers', transformers.__version__)"
	PYTHONPATH=$(CURDIR) $(DEVICE_VENV)/bin/python -m pytest -q -p no:cacheprovider $(COMPAT_TESTS)

compat-floor: $(FLOOR_VENV)/.installed
	$(FLOOR_VENV)/bin/python -c "import torch, transformers, networkx; \
		print('$(FLOOR_VENV): torch', torch.__version__, 'transformers', transformers.__version__, \
		'networkx', networkx.__version__)"
	PYTHONPATH=$(CURDIR) $(FLOOR_VENV)/bin/python -m pytest -q -p no:cacheprovider $(FLOOR_TESTS)

ci: test docs device-dry-run compat
