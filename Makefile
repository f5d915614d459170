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

.PHONY: venv test test-fast lint walkthrough lab bench info clean strip

venv: $(STAMP)

$(STAMP): pyproject.toml requirements/pins.txt Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if [ -n "$(TORCH)" ]; then $(PY) -m pip install -q "$(TORCH)"; fi
	$(PY) -m pip install -q -c requirements/pins.txt -e ".[$(EXTRAS)]"
	@touch $(STAMP)

lint: venv
	$(VENV)/bin/ruff check moekit tests notebooks benchmarks tools

# On a CUDA machine the `interpreter` tests (CPU tensors into the kernels) skip in the first run,
# which compiles for the GPU; the second run gives them Triton's interpreter, as CI does.
test: venv lint
	$(PY) -m pytest -q $(ARGS)
	@if [ "$${MOEKIT_DEVICE:-}" != cpu ] && $(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		echo "CUDA machine: the interpreter tests again, on the CPU (MOEKIT_DEVICE=cpu)"; \
		MOEKIT_DEVICE=cpu $(PY) -m pytest -q -m interpreter $(ARGS); \
	fi

test-fast: venv
	$(PY) -m pytest -q -m "not notebooks and not browser and not slow" $(ARGS)

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
