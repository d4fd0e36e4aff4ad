# ecoscan developer commands. `make run` and `make test` work on a fresh machine
# with Python 3.11: they create .venv and install what they need (`make test`, as root
# with apt-get, the system packages its tests need too: tests/system-deps.sh).

PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: run test system-deps fuzz lint typecheck check sim bench-images clean image

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	@touch $@

run: $(VENV)/.installed
	$(BIN)/uvicorn app.main:app --http app.http.protocol:HttpToolsProtocol --host $(HOST) --port $(PORT)

# pytest on TEST_WORKERS processes (pytest-xdist): more than the cores, as most of a test's
# time is spent waiting on processes; the count is measured in docs/benchmarks.md.
TEST_WORKERS ?= 6
# tests/system-deps.sh first: the system packages and the dockerd the tests need, installed
# as root with apt-get, else named and the run stopped before it starts. SYSTEM_DEPS=skip:
# not checked (the tests whose tool is missing fail, or skip where docker is missing).
SYSTEM_DEPS ?= install
PYTEST_ARGS ?=
test: system-deps $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

system-deps:
ifeq ($(SYSTEM_DEPS),skip)
	@echo "SYSTEM_DEPS=skip: system packages for the tests not checked"
else
	@bash tests/system-deps.sh
endif

# The OpenAPI fuzz (tests/test_openapi.py) at length: `make test` runs it bounded (20
# examples per operation, fixed seed); this runs FUZZ_MAX_EXAMPLES, with FUZZ_SEED to vary.
FUZZ_MAX_EXAMPLES ?= 500
FUZZ_SEED ?= 20261122
fuzz: $(VENV)/.installed
	FUZZ_MAX_EXAMPLES=$(FUZZ_MAX_EXAMPLES) FUZZ_SEED=$(FUZZ_SEED) \
		$(BIN)/python -m pytest -q -p no:cacheprovider --timeout 3600 tests/test_openapi.py -k fuzz

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(VENV)/.installed
	$(BIN)/mypy

sim: $(VENV)/.installed
	$(BIN)/python -m app.sim --host $(HOST) --port 8100

# The container image (multi-stage Dockerfile). BASE_IMAGE: where Docker Hub is out of
# reach, `make image BASE_IMAGE="$$(deploy/base-image/build.sh)"` builds one from Debian.
IMAGE      ?= ecoscan:dev
BASE_IMAGE ?= python:3.11-slim
DOCKER     ?= docker
image:
	$(DOCKER) build --build-arg BASE_IMAGE=$(BASE_IMAGE) -t $(IMAGE) .

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
