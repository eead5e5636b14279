# `make train` and `make test` each set everything up first (a .venv with the project and
# its dev tools), so both work on a fresh machine with nothing installed by hand.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
ARGS   ?=

.PHONY: setup train test test-all lint format bench clean

$(STAMP): pyproject.toml setup.py fastload/decode/_jpeg_region.c fastload/decode/_nvimgcodec_batch.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

train: setup                 ## train on the built-in synthetic dataset (ARGS="loader=bg ...")
	$(PY) train.py $(ARGS)

# One pytest worker per core, at most 8 (pytest-xdist): most of a test's time is a train.py
# or torchrun subprocess on one core, so two workers on two cores take ~2/3 of one's time. worksteal: the 20-40 s end-to-end tests leave no worker idle at the end.
# TEST_JOBS=0 (or ARGS="-n 0") runs in one process: pdb, -x, one test's output.
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 8 ] && n=8; echo $$n)
XDIST  := -n $(TEST_JOBS) --dist worksteal

test: setup                  ## the fast default suite (no slow/cuda/docker markers)
	$(PY) -m pytest -q $(XDIST) $(ARGS)

test-all: setup              ## everything this machine can run, slow tests included
	$(PY) -m pytest -q $(XDIST) -m "not cuda and not docker" $(ARGS)

lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/hadolint Dockerfile

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache .ruff_cache
