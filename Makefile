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
	$(VENV)/bin/lab models fetch qwen2.5-coder-1.5b qwen2.5-coder-0.5b
	$(VENV)/bin/lab run --profile default
	$(VENV)/bin/lab bench kernels --json > $(OUT)/default/kernels.json.tmp && mv $(OUT)/default/kernels.json.tmp $(OUT)/default/kernels.json
	$(VENV)/bin/lab bench decode --json > $(OUT)/default/decode.json.tmp && mv $(OUT)/default/decode.json.tmp $(OUT)/default/decode.json
	$(VENV)/bin/lab bench vk --json > $(OUT)/default/vk.json.tmp && mv $(OUT)/default/vk.json.tmp $(OUT)/default/vk.json
	@echo "report: $(OUT)/default/index.html"

lab: setup
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks $(JUPYTER_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
