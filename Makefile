# Two commands do all set-up on a fresh machine with python3 and make:
#   make serve   - virtualenv + server install, then the service on the best device (CPU fallback)
#   make test    - same environment plus test tools, then the whole suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed before the package so that the `torch>=2.4` range is already met, from
# pip's configured index: which build that is depends on the index (on Linux x86_64 PyPI's
# wheels are CUDA builds; https://download.pytorch.org/whl/cpu or .../whl/cu126 as
# PIP_EXTRA_INDEX_URL picks a CPU-only or another CUDA build). TORCH_SPEC=... names another.
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000
DEVICE ?= auto

.PHONY: serve test lint bench clean browser

$(VENV)/.server-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[all]"
	touch $@

$(VENV)/.test-installed: $(VENV)/.server-installed
	$(PY) -m pip install --quiet -e ".[all,test]"
	touch $@

# The web page's tests drive a real headless browser: Debian's chromium and chromium-driver,
# installed from the system's package registry when either is missing (CI runs as root on
# Debian). Elsewhere without root the browser tests skip, saying so.
browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then \
	  :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver; \
	else \
	  echo "make: chromium or chromedriver is missing and cannot be installed here (needs root" \
	       "and apt-get): the browser tests will be skipped"; \
	fi

serve: $(VENV)/.server-installed
	$(VENV)/bin/pyhf-gpu-server --host $(HOST) --port $(PORT) --device $(DEVICE)

# Four pytest processes, each taking whole test files (their module-scoped servers stay
# shared): most tests wait on real servers and subprocesses, so they overlap their waits, and
# where another process keeps a core busy the suite keeps the larger share of the two cores.
# The files go out in collection order, which tests/conftest.py starts with those holding a
# test marked slow.
# PYTEST_WORKERS=0 runs them in this process. Tests marked one_process (schemathesis' route
# tests, which share one node id) run in pytest's own after.
PYTEST_WORKERS ?= 4
# The pytest plugins the suite uses, named instead of autoloaded: pytest marks every module of
# an autoloaded plugin's distribution for assertion rewriting, and where PYTHONDONTWRITEBYTECODE
# is set (as on CI's machines) each pytest process rewrote schemathesis', hypothesis', anyio's
# and boost-histogram's ~380 modules anew (a third of its start-up).
PYTEST_PLUGINS := --disable-plugin-autoload -p xdist.plugin -p pytest_timeout \
	-p _hypothesis_pytestplugin -p schemathesis.pytest.plugin

# One OpenMP thread per process (torch's intra-op pool, BLAS): the suite runs PYTEST_WORKERS
# processes, each with its server subprocesses, on as few as 2 cores (CI's), where a pool of a
# thread per core in every process has their threads spin against each other's; its fits are
# small and batched, latency-bound, and gain nothing from a second thread there.
PYTEST_ENV := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

test: $(VENV)/.test-installed browser
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PYTEST_ENV) $(PY) -m pytest $(PYTEST_PLUGINS) -n $(PYTEST_WORKERS) --dist loadfile \
	    --no-loadscope-reorder -m "not one_process"
	$(PYTEST_ENV) $(PY) -m pytest $(PYTEST_PLUGINS) -m one_process

lint: $(VENV)/.test-installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench: $(VENV)/.test-installed
	$(PY) benchmarks/bench_engine.py

clean:
	rm -rf $(VENV) build *.egg-info
