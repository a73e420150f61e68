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

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The inner loop: everything but the tests marked slow (those that start servers, ranks or bench
# scripts, or run long). CI runs `make test`, which includes them. One torch thread by default
# (FAST_THREADS=2 for two): where other processes share the cores, torch's OpenMP threads wait on
# each other at every parallel region and the same run takes many times longer. `make test` keeps
# torch's default, so the multi-threaded kernel paths still run there. The fast tests are spread over
# FAST_WORKERS pytest-xdist processes (one per core here; FAST_WORKERS=0 runs them in this process).
FAST_THREADS ?= 1
FAST_WORKERS ?= 2
test-fast: $(STAMP)
	OMP_NUM_THREADS=$(FAST_THREADS) $(PY) -m pytest -q -m "not slow" $(if $(filter-out 0,$(FAST_WORKERS)),-n $(FAST_WORKERS)) $(PYTEST_ARGS)

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
