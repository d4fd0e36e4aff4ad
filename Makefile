# ecoscan developer commands. `make run` and `make test` work on a fresh machine
# with Python 3.11: they create .venv and install what they need.

PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: run test lint typecheck check sim bench-images clean

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	@touch $@

run: $(VENV)/.installed
	$(BIN)/uvicorn app.main:app --http app.http_protocol:HttpToolsProtocol --host $(HOST) --port $(PORT)

test: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(VENV)/.installed
	$(BIN)/mypy

sim: $(VENV)/.installed
	$(BIN)/python -m app.sim --host $(HOST) --port 8100

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
