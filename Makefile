# Quick start: `make test` builds .venv from this repository's files alone, then runs the suite.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.locus-installed
TORCH_VERSION ?= 2.13.0

.PHONY: test test-fast serve generate venv clean

venv: $(STAMP)

# torch goes in first and pinned: a bare `torch` requirement in an empty venv pulls CUDA wheels.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==$(TORCH_VERSION)
	$(PY) -m pip install -e '.[test,plots]'
	touch $(STAMP)

# The inner loop: everything but the tests marked slow (those that start servers, ranks or bench
# scripts, or run long). One torch thread by default (FAST_THREADS=2 for two): where other processes
# share the cores, torch's OpenMP threads wait on each other at every parallel region and the same run
# takes many times longer; the kernels' multi-threaded paths are checked by tests that set the thread
# count themselves (tests/kernels/test_moe_cpu.py, test_argmax_cpu.py). The fast tests are spread over
# FAST_WORKERS pytest-xdist processes (one per core here; FAST_WORKERS=0 runs them in this process).
FAST_THREADS ?= 1
FAST_WORKERS ?= 2
FAST_PYTEST = OMP_NUM_THREADS=$(FAST_THREADS) $(PY) -m pytest -q -m "not slow" $(if $(filter-out 0,$(FAST_WORKERS)),-n $(FAST_WORKERS)) $(PYTEST_ARGS)
test-fast: $(STAMP)
	$(FAST_PYTEST)

# CI's suite, every test: the fast ones as `make test-fast` runs them, then the slow ones (servers,
# rank processes, bench scripts: timing-sensitive where they share 2 cores) one at a time in one
# process with torch's default threads. Both halves always run; the target fails if either does
# (pytest's 5, nothing selected, is not a failure: PYTEST_ARGS may select tests of one half only).
test: $(STAMP)
	@fast=0; $(FAST_PYTEST) || fast=$$?; [ $$fast = 5 ] && fast=0; \
	slow=0; $(PY) -m pytest -q -m slow $(PYTEST_ARGS) || slow=$$?; [ $$slow = 5 ] && slow=0; \
	echo "make test: fast tests exit $$fast, slow tests exit $$slow"; [ $$fast = 0 ] && [ $$slow = 0 ]

# The OpenAI-compatible server on the shipped trained model `mini` (locus/assets/mini, 7M parameters;
# no download). --model tiny serves the random-weight preset instead.
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=
serve: $(STAMP)
	$(VENV)/bin/locus serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# A short generation on the shipped trained model.
generate: $(STAMP)
	$(VENV)/bin/locus generate --model mini --prompt "def fibonacci(n):" --max-tokens 48 --temperature 0.7 --top-k 40 --seed 0

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
