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

.PHONY: setup llama test report lab native clean fuzz fuzz-toolchain fuzz-build fuzz-seeds FORCE

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11 or newer is needed"'
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	@$(PY) -c 'import torch, sys; sys.exit("torch is a CUDA build: rerun with TORCH_INDEX=<PyTorch CPU index>" if torch.version.cuda else 0)'
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

# llama.cpp for the baselines section (llama-cpp-python, pinned in pyproject's "llama" extra).
# It compiles llama.cpp at install (minutes), so it is its own step: make report and CI take
# it; without it the baselines section and its tests leave llama.cpp out, saying why.
# LLAVA_BUILD=OFF: the multimodal library is not needed here.
LLAMA_STAMP := $(VENV)/.llama
llama: $(LLAMA_STAMP)

$(LLAMA_STAMP): $(STAMP)
	CMAKE_ARGS="-DLLAVA_BUILD=OFF $(LLAMA_CMAKE_ARGS)" $(PIP) install -q -e ".[dev,llama]"
	touch $(LLAMA_STAMP)

native: setup
	$(PY) -c 'from lab import native; print("native library:", native.build())'

test: native
	$(PY) -m pytest -q

report: native llama
	$(VENV)/bin/lab models fetch qwen2.5-coder-1.5b qwen2.5-coder-0.5b
	$(VENV)/bin/lab run --profile default
	$(VENV)/bin/lab bench kernels --json > $(OUT)/default/kernels.json.tmp && mv $(OUT)/default/kernels.json.tmp $(OUT)/default/kernels.json
	$(VENV)/bin/lab bench decode --json > $(OUT)/default/decode.json.tmp && mv $(OUT)/default/decode.json.tmp $(OUT)/default/decode.json
	$(VENV)/bin/lab bench vk --json > $(OUT)/default/vk.json.tmp && mv $(OUT)/default/vk.json.tmp $(OUT)/default/vk.json
	@echo "report: $(OUT)/default/index.html"

lab: setup
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks $(JUPYTER_ARGS)

# ---------------------------------------------------------------------------
# Fuzzing (fuzz/; each script's docstring says more). `make fuzz` builds a libFuzzer harness
# over the C++ reader and engine set-up (clang, -fsanitize=fuzzer,address,undefined, every
# kernels_cpp/*.cpp as lab/native.py compiles them) and runs it, then the atheris harness
# over Python's reader, FUZZ_SECONDS each, from a seed corpus of the tiny models' files.
# The long run: make fuzz FUZZ_RUNS=1000000 (that many inputs per harness). It installs no
# compiler: clang and libFuzzer come from Debian (apt-get install clang libclang-rt-dev llvm).
FUZZ_DIR ?= build/fuzz
FUZZ_SECONDS ?= 30
FUZZ_RUNS ?=
FUZZ_ARGS ?=
FUZZ_CXX ?= clang++
# What lab/native.py passes (-O3 and -shared aside), plus the sanitizers and debug info.
FUZZ_CXXFLAGS ?= -std=c++20 -O1 -g -fno-omit-frame-pointer -pthread -ffp-contract=off -fno-fast-math \
	-Wall -Wno-unknown-warning-option -Wno-uninitialized
FUZZ_SANITIZE ?= -fsanitize=address,undefined -fno-sanitize-recover=undefined
# More flags for the C++ build, e.g. -fno-sanitize=alignment while that report is open.
FUZZ_EXTRA ?=
FUZZ_FLAGS := $(FUZZ_CXX) $(FUZZ_CXXFLAGS) $(FUZZ_SANITIZE) $(FUZZ_EXTRA)
FUZZ_SOURCES := $(wildcard kernels_cpp/*.cpp kernels_cpp/*.h kernels_cpp/*.inc)
FUZZ_OBJS := $(patsubst kernels_cpp/%.cpp,$(FUZZ_DIR)/obj/%.o,$(wildcard kernels_cpp/*.cpp))
FUZZ_MISSING := clang with libFuzzer and the sanitizer runtimes is needed; on Debian: \
	apt-get install clang libclang-rt-dev llvm (or point FUZZ_CXX at a clang++ that has them)

fuzz: fuzz-toolchain native fuzz-build fuzz-seeds
	@$(PY) -c 'import atheris' 2>/dev/null || { echo "make fuzz: atheris is missing from $(VENV) (a dev dependency: make setup)"; exit 1; }
	@rc=0; \
	FUZZ_DIR=$(FUZZ_DIR) FUZZ_SECONDS=$(FUZZ_SECONDS) FUZZ_RUNS=$(FUZZ_RUNS) FUZZ_ARGS="$(FUZZ_ARGS)" fuzz/run.sh cpp || rc=1; \
	FUZZ_DIR=$(FUZZ_DIR) FUZZ_SECONDS=$(FUZZ_SECONDS) FUZZ_RUNS=$(FUZZ_RUNS) FUZZ_ARGS="$(FUZZ_ARGS)" PY=$(PY) fuzz/run.sh py || rc=1; \
	exit $$rc

# Checks, installs nothing: the compiler, then a fuzz target linked with every runtime.
fuzz-toolchain:
	@command -v $(FUZZ_CXX) >/dev/null 2>&1 || { echo "make fuzz: $(FUZZ_CXX) not found: $(FUZZ_MISSING)"; exit 1; }
	@mkdir -p $(FUZZ_DIR)
	@printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' \
		> $(FUZZ_DIR)/toolchain.cpp
	@$(FUZZ_CXX) -fsanitize=fuzzer,address,undefined $(FUZZ_DIR)/toolchain.cpp -o $(FUZZ_DIR)/toolchain \
		> $(FUZZ_DIR)/toolchain.log 2>&1 \
		|| { tail -3 $(FUZZ_DIR)/toolchain.log; echo "make fuzz: $(FUZZ_CXX) cannot link -fsanitize=fuzzer,address,undefined: $(FUZZ_MISSING)"; exit 1; }

fuzz-build: fuzz-toolchain $(FUZZ_DIR)/model_file_fuzzer

# kernels_cpp/ as clang reads it (GCC's target pragmas translated line for line).
$(FUZZ_DIR)/src/.stamp: $(FUZZ_SOURCES) fuzz/clang_sources.py
	$(PYTHON) fuzz/clang_sources.py kernels_cpp $(FUZZ_DIR)/src
	@touch $@

# Rebuilds when the flags change (FUZZ_EXTRA, FUZZ_SANITIZE, ...).
$(FUZZ_DIR)/flags: FORCE
	@mkdir -p $(@D)
	@echo '$(FUZZ_FLAGS)' | cmp -s - $@ || echo '$(FUZZ_FLAGS)' > $@

$(FUZZ_DIR)/obj/%.o: $(FUZZ_DIR)/src/.stamp $(FUZZ_DIR)/flags
	@mkdir -p $(@D)
	$(FUZZ_CXX) $(FUZZ_CXXFLAGS) $(FUZZ_SANITIZE) -fsanitize=fuzzer-no-link $(FUZZ_EXTRA) -c $(FUZZ_DIR)/src/$*.cpp -o $@

$(FUZZ_DIR)/model_file_fuzzer: fuzz/model_file_fuzzer.cpp $(FUZZ_OBJS) $(FUZZ_DIR)/flags
	$(FUZZ_CXX) $(FUZZ_CXXFLAGS) $(FUZZ_SANITIZE) -fsanitize=fuzzer $(FUZZ_EXTRA) -I$(FUZZ_DIR)/src \
		fuzz/model_file_fuzzer.cpp $(FUZZ_OBJS) -o $@

# The seed corpus: the tiny models' files under every scheme (not committed).
fuzz-seeds: $(FUZZ_DIR)/seeds.stamp

$(FUZZ_DIR)/seeds.stamp: fuzz/seeds.py lab/models/export.py lab/models/tiny.py lab/formats.py | native
	rm -rf $(FUZZ_DIR)/seeds
	$(PY) fuzz/seeds.py $(FUZZ_DIR)/seeds
	@touch $@

FORCE:

clean:
	rm -rf $(VENV) build *.egg-info
