PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The tests compare against PyTorch's CPU build, from PyTorch's CPU wheel index: PyPI's Linux
# torch is the CUDA build (about 17 NVIDIA packages, several GB). Left out where that index
# cannot be reached (a machine that provides its own CPU wheel through pip's configuration);
# `make test TORCH_INDEX=` leaves it out too.
TORCH_INDEX ?= $(shell $(PYTHON) -c "import os, socket; os.environ.get('HTTPS_PROXY') or os.environ.get('https_proxy') or socket.getaddrinfo('download.pytorch.org', 443)" >/dev/null 2>&1 && echo https://download.pytorch.org/whl/cpu)
TEST_PIP_FLAGS := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))

.PHONY: demo test lint bench notebooks clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e ".[viz,uvloop]"
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install $(TEST_PIP_FLAGS) -e ".[test]"
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install $(TEST_PIP_FLAGS) -e ".[dev]"
	touch $@

$(VENV)/.installed-bench: pyproject.toml | $(BIN)/python
	$(BIN)/pip install $(TEST_PIP_FLAGS) -e ".[test,bench]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python -m aioautograd.examples.concurrent_training

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check aioautograd tests benchmarks notebooks
	$(BIN)/ruff format --check aioautograd tests benchmarks notebooks
	$(BIN)/mypy aioautograd

notebooks: $(VENV)/.installed-test
	$(BIN)/python notebooks/execute.py

bench: $(VENV)/.installed-bench
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info
