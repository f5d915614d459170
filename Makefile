# moekit: every target installs what it needs into .venv first, so on a fresh machine
# `make test` and `make walkthrough` are single commands.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Keep a CUDA torch you already have: `make venv TORCH=` skips installing torch, or name another
# spec, e.g. `make venv TORCH="torch==2.11.0"`.
TORCH ?= torch==2.13.0
EXTRAS ?= notebooks,dev,hf
STAMP := $(VENV)/.moekit-installed
ARGS ?=

.PHONY: venv test test-fast test-lowest lint walkthrough lab bench info clean strip mutation

venv: $(STAMP)

$(STAMP): pyproject.toml requirements/pins.txt Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if [ -n "$(TORCH)" ]; then $(PY) -m pip install -q "$(TORCH)"; fi
	$(PY) -m pip install -q -c requirements/pins.txt -e ".[$(EXTRAS)]"
	@touch $(STAMP)

lint: venv
	$(VENV)/bin/ruff check moekit tests notebooks benchmarks tools

# Two pytest workers (pytest-xdist), notebooks included, each worker taking the next test when it is
# free: Triton's interpreter keeps one core busy per process, so on 2 cores that nearly halves the
# suite (in one process it took 24 min for the tests and 12 for the notebooks).
# On a CUDA machine the `interpreter` tests (CPU tensors into the kernels) skip in the first run,
# which compiles for the GPU; the second run gives them Triton's interpreter, as CI does.
test: venv lint
	$(PY) -m pytest -q -n 2 --dist worksteal --durations=60 $(ARGS)
	@if [ "$${MOEKIT_DEVICE:-}" != cpu ] && $(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		echo "CUDA machine: the interpreter tests again, on the CPU (MOEKIT_DEVICE=cpu)"; \
		MOEKIT_DEVICE=cpu $(PY) -m pytest -q -m interpreter $(ARGS); \
	fi

test-fast: venv
	$(PY) -m pytest -q -m "not notebooks and not browser and not slow" $(ARGS)

# The lowest supported triton (and TORCH_LOWEST) with the newest numpy they admit, in a venv of
# its own (requirements/pins-lowest.txt says why numpy stops at 2.3 there): the interpreter tests.
LOWEST_VENV ?= build/venv-lowest
TORCH_LOWEST ?= torch==2.13.0
# The kernels, experts and chunk loop on the CPU (what the triton/numpy pair can break); the
# distributed, notebook and optional-extra tests stay with `make test`.
LOWEST_TESTS ?= tests/kernels tests/experts tests/test_modular_kernel.py tests/test_row_plan.py tests/test_api.py \
	tests/test_reference.py tests/test_properties.py tests/prepare_finalize/test_no_ep.py \
	tests/prepare_finalize/test_batched.py tests/prepare_finalize/test_base.py tests/workbook
LOWEST_MARKERS ?= not slow and not notebooks and not browser and not hf and not gpu and not distributed
LOWEST_STAMP := $(LOWEST_VENV)/.moekit-installed

$(LOWEST_STAMP): pyproject.toml requirements/pins-lowest.txt Makefile
	@test -x $(LOWEST_VENV)/bin/python || $(PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_VENV)/bin/python -m pip install -q "$(TORCH_LOWEST)" -r requirements/pins-lowest.txt
	$(LOWEST_VENV)/bin/python -m pip install -q -c requirements/pins-lowest.txt --no-deps -e .
	$(LOWEST_VENV)/bin/python -c "import torch, triton, numpy; print('lowest:', torch.__version__, triton.__version__, numpy.__version__)"
	@touch $(LOWEST_STAMP)

test-lowest: $(LOWEST_STAMP)
	$(LOWEST_VENV)/bin/python -m pytest -q -p no:cacheprovider -m "$(LOWEST_MARKERS)" $(LOWEST_TESTS) $(ARGS)

# A mutation run over the core (tools/mutation.py): about 15 minutes on 2 cores, not part of `make test`.
mutation: venv
	$(PY) -m tools.mutation $(ARGS)

walkthrough: venv
	$(PY) -m moekit.cli walkthrough $(ARGS)

# As root (containers, CI) JupyterLab refuses to start without --allow-root; it still listens on
# localhost only, with a token.
lab: venv
	$(VENV)/bin/jupyter lab notebooks --ip=127.0.0.1 $(if $(filter 0,$(shell id -u)),--allow-root)

bench: venv
	$(PY) -m benchmarks.harness $(ARGS)

info: venv
	$(PY) -m moekit.cli info

strip: venv
	$(VENV)/bin/nbstripout notebooks/*.ipynb

clean:
	rm -rf build .pytest_cache
