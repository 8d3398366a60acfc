# Set-up commands for a fresh machine (Python 3.11 + pip). Each target installs what it needs.
PYTHON ?= python3
# These machines carry a CPU build of torch 2.13.0; an unpinned torch would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: install-train install-test demo test lint bench

install-train:
	$(PYTHON) -m pip install -q "$(TORCH)"
	$(PYTHON) -m pip install -q -e ".[train]"

install-test:
	$(PYTHON) -m pip install -q "$(TORCH)"
	$(PYTHON) -m pip install -q -e ".[test,torchtitan]"  # torchtitan: ~40 s, ~0.4 GB; for its tests

demo: install-train
	$(PYTHON) -m shardscale train

test: install-test
	$(PYTHON) -m ruff check src tests benchmarks
	$(PYTHON) -m pytest -q --durations=10

bench: install-train
	$(PYTHON) benchmarks/bench.py
