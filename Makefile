# `make train` and `make test` each set everything up first (a .venv with the project and
# its dev tools), so both work on a fresh machine with nothing installed by hand.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
ARGS   ?=

.PHONY: setup train test test-all lint format bench clean

$(STAMP): pyproject.toml fastload/decode/_jpeg_region.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

train: setup                 ## train on the built-in synthetic dataset (ARGS="loader=bg ...")
	$(PY) train.py $(ARGS)

test: setup                  ## the fast default suite (no slow/cuda/docker markers)
	$(PY) -m pytest -q $(ARGS)

test-all: setup              ## everything this machine can run, slow tests included
	$(PY) -m pytest -q -m "not cuda and not docker" $(ARGS)

lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/hadolint Dockerfile

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache .ruff_cache
