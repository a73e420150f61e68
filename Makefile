# Quick start: `make serve` builds .venv with what serving needs, `make test` adds the test set and runs
# the suite. Every version comes from the committed lock (requirements/*.txt, hashed; made by `make lock`,
# see requirements/README.md), so a fresh machine builds the same environment whatever the newest releases.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# Where torch comes from: empty = pip's own configuration (PyPI's default build is the CUDA one);
# TORCH_INDEX=https://download.pytorch.org/whl/cpu for the CPU build, .../whl/cu130 for a CUDA build.
TORCH_INDEX ?=
SERVE_STAMP := $(VENV)/.locus-serve
TEST_STAMP := $(VENV)/.locus-test

.PHONY: test test-fast serve generate venv venv-serve lock clean

venv: $(TEST_STAMP)
venv-serve: $(SERVE_STAMP)

# torch first, pinned, with its own dependencies from TORCH_INDEX (the CUDA build brings nvidia-*
# packages and its own triton, which the lock does not list); the locked triton where torch brought
# none (requirements/triton.in says why it is locked apart); then the locked set with --no-deps and
# --require-hashes, so nothing unlocked enters; then Locus itself without build isolation (setuptools is locked too); `pip check`
# proves the result consistent and the freeze puts the installed versions in the log.
define install_set
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install torch==$(TORCH_VERSION) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	if $(PY) -c "import importlib.metadata as m, sys; sys.exit(any(r.startswith('triton') for r in m.requires('torch') or []))"; \
		then $(PY) -m pip install --require-hashes --no-deps -r requirements/triton.txt; fi
	$(PY) -m pip install --require-hashes --no-deps -r requirements/$(1).txt
	$(PY) -m pip install --no-deps --no-build-isolation -e .
	$(PY) -m pip check
	@echo "locked environment ($(1)):"; $(PY) -m pip freeze --exclude-editable | tr '\n' ' '; echo
endef

$(SERVE_STAMP): requirements/serve.txt requirements/triton.txt pyproject.toml Makefile
	$(call install_set,serve)
	touch $(SERVE_STAMP)

# The test set is a superset of the serving set: once it is in, serving needs nothing more.
$(TEST_STAMP): requirements/test.txt requirements/triton.txt pyproject.toml Makefile
	$(call install_set,test)
	touch $(TEST_STAMP) $(SERVE_STAMP)

# Re-resolve every set to the newest releases (a deliberate upgrade: commit the changed lock files with
# the test result), then rebuild the venv from them and run the fast tests. uv resolves (it writes
# hashed requirement files plain pip installs); it runs from a throwaway tool venv.
LOCK_TOOL ?= /tmp/locus-lock-tool
LOCK_ARGS ?=
lock:
	test -x $(LOCK_TOOL)/bin/uv || (python3 -m venv $(LOCK_TOOL) && $(LOCK_TOOL)/bin/pip install uv)
	LOCK_UV=$(LOCK_TOOL)/bin/uv sh requirements/compile.sh --upgrade $(LOCK_ARGS)
	rm -f $(TEST_STAMP) $(SERVE_STAMP)
	$(MAKE) test-fast

# The inner loop: everything but the tests marked slow (those that start servers, ranks or bench
# scripts, or run long). One torch thread by default (FAST_THREADS=2 for two): where other processes
# share the cores, torch's OpenMP threads wait on each other at every parallel region and the same run
# takes many times longer; the kernels' multi-threaded paths are checked by tests that set the thread
# count themselves (tests/kernels/test_moe_cpu.py, test_argmax_cpu.py). The fast tests are spread over
# FAST_WORKERS pytest-xdist processes (one per core here; FAST_WORKERS=0 runs them in this process).
FAST_THREADS ?= 1
FAST_WORKERS ?= 2
FAST_PYTEST = OMP_NUM_THREADS=$(FAST_THREADS) $(PY) -m pytest -q -m "not slow" $(if $(filter-out 0,$(FAST_WORKERS)),-n $(FAST_WORKERS)) $(PYTEST_ARGS)
test-fast: $(TEST_STAMP)
	$(FAST_PYTEST)

# CI's suite, every test, in three parts that always all run: the fast tests as `make test-fast` runs
# them; the slow tests that may share the cores, over the same two workers: those that compute in the
# test process alone and those that start one single-process server, CLI command or bench script
# (tests/conftest.py decides by what a test launches, and anything unsure is `serial`), handed out a
# module at a time (--dist loadscope: a module-scoped server or compiled model is built once, not once
# per worker); then the `serial` slow tests, those that start rank groups, several servers, network
# namespaces or tc, one at a time in one process (two multi-rank servers at once exhaust memory, and
# their collectives' timeouts are timing-sensitive on 2 busy cores). Every part runs one torch thread
# per process, the servers and ranks a test starts included (they inherit OMP_NUM_THREADS): four ranks
# of two threads each on 2 cores spend more CPU waiting on each other than computing. The target fails
# if any part does (pytest's 5, nothing selected, is not a failure: PYTEST_ARGS may select one part).
SLOW_SHARED_PYTEST = OMP_NUM_THREADS=$(FAST_THREADS) $(PY) -m pytest -q -m "slow and not serial" $(if $(filter-out 0,$(FAST_WORKERS)),-n $(FAST_WORKERS) --dist loadscope) $(PYTEST_ARGS)
test: $(TEST_STAMP)
	@fast=0; $(FAST_PYTEST) || fast=$$?; [ $$fast = 5 ] && fast=0; \
	shared=0; $(SLOW_SHARED_PYTEST) || shared=$$?; [ $$shared = 5 ] && shared=0; \
	serial=0; OMP_NUM_THREADS=$(FAST_THREADS) $(PY) -m pytest -q -m "slow and serial" $(PYTEST_ARGS) || serial=$$?; [ $$serial = 5 ] && serial=0; \
	echo "make test: fast tests exit $$fast, slow shared tests exit $$shared, slow serial tests exit $$serial"; \
	[ $$fast = 0 ] && [ $$shared = 0 ] && [ $$serial = 0 ]

# The OpenAI-compatible server on the shipped trained model `mini` (locus/assets/mini, 7M parameters;
# no download). --model tiny serves the random-weight preset instead.
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=
serve: $(SERVE_STAMP)
	$(VENV)/bin/locus serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# A short generation on the shipped trained model.
generate: $(SERVE_STAMP)
	$(VENV)/bin/locus generate --model mini --prompt "def fibonacci(n):" --max-tokens 48 --temperature 0.7 --top-k 40 --seed 0

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
