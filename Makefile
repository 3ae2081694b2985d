# gemma-tpu: `make demo` runs the course in the smoke profile, `make test` runs the test suite.
# Each target creates the virtual environments it needs when they are missing, and builds Icarus Verilog 12 (the
# version VerilogEval v2 requires; Debian 12 has 11) once into $(GEMMA_TPU_TOOLS), outside the clone.
# The Python that builds the venvs: 3.11 or later. python3 where it is one, else python3.13 / 3.12 / 3.11 from PATH
# (a stock TPU VM's python3 is 3.10); `make PYTHON=...` picks another, and a too old one stops in one line.
FIND_PYTHON := $(dir $(lastword $(MAKEFILE_LIST)))tools/find_python.sh
ifndef PYTHON
PYTHON := $(shell $(FIND_PYTHON))
endif
NEED_PYTHON = $(if $(shell $(FIND_PYTHON) '$(PYTHON)'),,$(error $(shell $(FIND_PYTHON) --why '$(PYTHON)')))
VENV := .venv
SERVE_VENV := .venv-serve
PY := $(VENV)/bin/python
PROFILE ?= smoke
JAX_CACHE_ALL := JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
export GEMMA_TPU_SERVE_PYTHON := $(abspath $(SERVE_VENV))/bin/python
# Built tools shared by every clone on the machine (CI reuses them); course/config/paths.py looks there too.
GEMMA_TPU_TOOLS ?= $(HOME)/.cache/gemma-tpu
export GEMMA_TPU_TOOLS
IVERILOG_PREFIX := $(GEMMA_TPU_TOOLS)/iverilog-12
export PATH := $(IVERILOG_PREFIX)/bin:$(PATH)

.PHONY: all setup venv tpu-venv serve-venv iverilog chromium lint check test test-slow demo site bench clean-runs \
	test-notebooks test-notebooks-pipeline test-notebooks-rest

all: demo

$(VENV)/.installed: requirements.txt requirements-common.txt pyproject.toml
	$(NEED_PYTHON)$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -r requirements.txt
	$(VENV)/bin/pip install -q --no-deps -e .
	touch $@

$(SERVE_VENV)/.installed: requirements-serve.txt
	$(NEED_PYTHON)$(PYTHON) -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/pip install -q --upgrade pip
	$(SERVE_VENV)/bin/pip install -r requirements-serve.txt
	$(SERVE_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

venv: $(VENV)/.installed
# TPU VM (stock image: Python 3.10, too old for google-tunix 0.1.7) or any machine: .venv on a uv-managed Python 3.12.
tpu-venv:
	tools/tpu_venv.sh $(VENV) requirements-tpu.txt
serve-venv: $(SERVE_VENV)/.installed

# Icarus Verilog 12.0 from Debian's source tarball: about 2 minutes the first time on a machine, then nothing.
iverilog:
	@tools/build_iverilog.sh $(IVERILOG_PREFIX)

# Headless Chromium (Debian's package) for tests/fast/test_site.py, which opens the course site in a real browser.
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium; }

# Everything `make test` needs. apt goes first and alone (dpkg serves one client at a time): Chromium and the Icarus
# build dependencies. Then the Icarus build (minutes of compiling) runs while pip fills the two venvs.
setup:
	@tools/build_iverilog.sh --deps-only $(IVERILOG_PREFIX)
	@$(MAKE) --no-print-directory chromium
	@$(MAKE) --no-print-directory -j3 --output-sync=line venv serve-venv iverilog

# ruff (pyproject.toml: line length, pyflakes, import order) over the package, tests, notebooks, tools and benches.
lint: venv
	@$(VENV)/bin/ruff check --quiet .

# The fast tier, after every edit (2.5 minutes on 2 cores): tests/fast holds the tests that need no trained
# run, no server and no multi-process training (unit tests of the fixes and the course, a step or two of training at
# most). Its JAX compilation cache lives beside the Icarus build, where a later `make check` finds it, and keeps
# every program (JAX_CACHE_ALL, below).
check: lint
	@JAX_COMPILATION_CACHE_DIR=$(GEMMA_TPU_TOOLS)/jax-cache-check $(JAX_CACHE_ALL) \
	$(PY) -m pytest tests/fast -q -m "not slow" -n 2 -p no:cacheprovider --durations=10

# One JAX compilation cache per `make test`, fresh each time (nothing carries over from an earlier run): the tests
# and notebooks compile the same smoke train step and model in dozens of processes; the later ones read it back
# (the learning check's step: 30 s cold, 16 s from the cache).
# JAX_CACHE_ALL: every program goes in the cache, not only those that take a second or more to compile (JAX's
# default). Each process compiles hundreds of small ones (loading the model onto the mesh, the LoRA's initialisation,
# eager ops on sharded arrays), the same ones in every training process and test worker: a 2-step `train` from a
# warm cache 20.4-21.4 s -> 19.5-19.8 s; tests/fast on two workers 201 -> 191 s from an empty cache, 177 -> 159 s
# from a warm one.
# One run directory for the notebooks, fresh too (your runs/ is left alone): tests/e2e/test_learn.py runs the
# README's `learn --profile smoke` in it (GEMMA_TPU_TEST_LEARNER), and notebooks 06 and 09 read that check back
# instead of training and serving it a second time (about 170 s of the notebooks' longest run); test_equivalence
# leaves notebook 06's PEFT parity run there (about 45 s more).
# OpenMP threads that wait passively: two workers share the cores, and a spinning thread takes the other's
# (tests/conftest.py measures it; the notebooks' kernels run two at a time too).
test: setup lint
	@export OMP_WAIT_POLICY=PASSIVE; \
	export JAX_COMPILATION_CACHE_DIR=$$(mktemp -d "$${TMPDIR:-/tmp}/gemma-tpu-jax-cache.XXXXXX") $(JAX_CACHE_ALL); \
	export GEMMA_TPU_TEST_LEARNER=$$(mktemp -d "$${TMPDIR:-/tmp}/gemma-tpu-test-runs.XXXXXX"); \
	$(PY) -m pytest tests/ -q -m "not slow" -n 2 --durations=25 && \
	GEMMA_TPU_RUNS=$$GEMMA_TPU_TEST_LEARNER/runs \
	$(MAKE) --no-print-directory -j2 --output-sync=target test-notebooks-pipeline test-notebooks-rest; \
	rc=$$?; rm -rf "$$JAX_COMPILATION_CACHE_DIR" "$$GEMMA_TPU_TEST_LEARNER"; exit $$rc

# The notebooks as two runs side by side on the one run directory: 06-09 in order (each uses what the one before
# built: the trained LoRA, the merged model), and the others, which need only the tiny base (built once under a lock,
# as figures.json is written). 10 goes first there: its vLLM server runs while 06 trains, not beside 08's and 09's
# (vLLM servers starting at once share one compile cache: vllm-project/vllm#24601). A notebook still runs alone
# (`make test-notebooks NB=notebooks/07_orbax_merge.ipynb`).
NB_PIPELINE := $(sort $(wildcard notebooks/0[6-9]_*.ipynb))
NB_BENCH := $(wildcard notebooks/10_*.ipynb)
NB_REST := $(NB_BENCH) $(filter-out $(NB_PIPELINE) $(NB_BENCH),$(sort $(wildcard notebooks/*.ipynb)))
NBMAKE = $(PY) -m pytest --nbmake --nbmake-timeout=1800 -q --durations=0 -p no:cacheprovider
NB ?= notebooks/
test-notebooks-pipeline:
	$(NBMAKE) $(NB_PIPELINE)
test-notebooks-rest:
	$(NBMAKE) $(NB_REST)
test-notebooks:
	$(NBMAKE) $(NB)

# The slow tests (AOT compiles of the 31B, the remat policy table, the MoE's learning check): minutes each on 2 cores.
test-slow: venv serve-venv iverilog
	$(PY) -m pytest tests/ -q -m slow

# The course site is built even when a notebook failed (its page shows the error); the failure still fails make.
demo: venv serve-venv iverilog
	$(PY) -m gemma_tpu_helpers demo --profile $(PROFILE) || { $(SITE); exit 1; }
	$(SITE)

# runs/$(PROFILE)/site: every executed notebook as HTML plus an index; opens from the file system, no server.
SITE = $(PY) -m gemma_tpu_helpers site --profile $(PROFILE)
site: venv
	$(SITE)

# Benchmarks print figures (no pass/fail on time), each job beside this machine's floor for the same job, measured in
# the same run: the streamed merge vs cp and vs its ΔW matmuls alone (merge/floor), for the bench checkpoint and the
# 31B projection; the data pipeline vs the bare tokenizer on the same rows at 1 and 2 processes (data/tokenizer); the
# smoke train step's CPU MFU and the helpers vs bare tunix; the 60-layer AOT plan and the run it predicts. The lines
# that hold the goals' figures are repeated at the end.
BENCH_FIGURES := ^(merge/cp|merge/floor|31B projection merge/floor|  [12] process|train step time ratio|smoke step)
bench: venv
	@log=$$(mktemp); \
	{ $(PY) bench/merge_bench.py && $(PY) bench/train_step_bench.py && $(PY) bench/data_bench.py && \
	  $(PY) -m gemma_tpu_helpers plan --profile v5p-8 --aot --layers 60; echo $$? > $$log.rc; } 2>&1 | tee $$log; \
	echo; echo "== the figures against their floors"; grep -E '$(BENCH_FIGURES)' $$log; \
	rc=$$(cat $$log.rc 2>/dev/null || echo 1); rm -f $$log $$log.rc; exit $$rc

clean-runs:
	rm -rf runs/
