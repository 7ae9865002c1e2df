# The two commands (see README): `make report` sets up and runs the main job,
# `make test` sets up and runs the tests. `make lab` opens JupyterLab in the same environment.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# PyTorch must be the CPU build: a bare "torch" from PyPI is a CUDA build of several GB.
# Where no CPU wheel of this version is on hand, point this at PyTorch's CPU index.
TORCH := torch==2.13.0
TORCH_INDEX ?=
OUT := outputs

.PHONY: setup test report lab native clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11 or newer is needed"'
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	@$(PY) -c 'import torch, sys; sys.exit("torch is a CUDA build: rerun with TORCH_INDEX=<PyTorch CPU index>" if torch.version.cuda else 0)'
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

native: setup
	$(PY) -c 'from lab import native; print("native library:", native.build())'

test: native
	$(PY) -m pytest -q

report: native
	@mkdir -p $(OUT)
	$(VENV)/bin/lab info
	$(VENV)/bin/lab bench bandwidth --json > $(OUT)/bandwidth.json.tmp && mv $(OUT)/bandwidth.json.tmp $(OUT)/bandwidth.json
	$(VENV)/bin/lab bench kernels --json > $(OUT)/kernels.json.tmp && mv $(OUT)/kernels.json.tmp $(OUT)/kernels.json
	@$(PY) -c 'import json; from lab.cli import _print_bandwidth, _print_kernels; \
	  _print_bandwidth(json.load(open("$(OUT)/bandwidth.json"))); _print_kernels(json.load(open("$(OUT)/kernels.json")))'

lab: setup
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks $(JUPYTER_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
