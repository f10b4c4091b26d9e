# syntax=docker/dockerfile:1
# Tandem GPU executor: CUDA torch (PyPI's torch wheels carry the CUDA libraries; the node's
# driver comes in through the NVIDIA container runtime).
# Build from the repository root: docker build -f docker/executor-gpu.Dockerfile -t tandem/executor-gpu .

# The base image: the official Python image by default; the image tests build from a local
# Debian bookworm base with the same Python (scripts/build_base_image.sh) where no registry is
# reachable.
ARG BASE_IMAGE=python:3.11.13-slim-bookworm

# A throwaway stage: the requirement files and the project's wheel (gRPC stubs generated with
# grpcio-tools, which stays here). The venv is installed once, in the final stage: copying a
# venv built here would store torch's GBs twice (this stage's layer, then the copy's).
FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml docker/pyproject_requirements.py ./
# Which torch: unset, the gpu extra's pin from PyPI (the CUDA build). A CPU-only image (CPU
# nodes, tests), either TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu (its 2.9.0+cpu
# meets the pin), or TORCH naming another torch, e.g. TORCH=torch==2.13.0+cpu, with pip finding
# its wheel through the pip.conf secret (below). TORCH replaces the pin and nothing else.
# Arguments of this stage only: the final stage gets their effect through torch.txt.
ARG TORCH
ARG TORCH_INDEX_URL
RUN python pyproject_requirements.py --only-torch --torch "$TORCH" >torch.txt \
 && if [ -n "$TORCH_INDEX_URL" ]; then echo "--extra-index-url $TORCH_INDEX_URL" >>torch.txt; fi \
 && python pyproject_requirements.py gpu --torch "$TORCH" >requirements.txt
COPY proto ./proto
COPY common ./common
COPY executor_gpu ./executor_gpu
# pip's index, mirror, CA bundle or find-links come from an optional build secret, a pip.conf
# (podman/docker build --secret id=pip.conf,src=FILE): never in a layer or the image history.
# The stubs' grpcio and protobuf versions are resolved here and the runtime's in the final
# stage, at the same time: the final stage imports the stubs, which check both versions.
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf \
    python -m venv /opt/tools \
 && /opt/tools/bin/pip install "grpcio-tools>=1.66" \
 && /opt/tools/bin/python -m grpc_tools.protoc -Icommon/wire/pb=proto --python_out=. --grpc_python_out=. proto/executor.proto \
 && /opt/tools/bin/pip wheel --no-deps -w /wheels .

FROM ${BASE_IMAGE}
RUN groupadd --system --gid 10001 tandem \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin tandem \
 && mkdir -p /opt/tandem
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# torch alone first: its layer (GBs with CUDA) is written once per pin, not once per source
# change, and shared with the TPU image (executor-tpu.Dockerfile has the same lines up to here).
COPY --from=build /src/torch.txt /tmp/build/
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf \
    python -m venv /opt/venv \
 && pip install -r /tmp/build/torch.txt
# Triton (torch's kernel compiler on CUDA) builds a small C launcher with the system C compiler
# the first time it launches a kernel, against the C library's and Python's headers (Python's
# come with the base image): without a compiler that first launch fails. On a CPU node the
# executor's C++ kernels (executor_gpu/cpu/) are compiled at first use for the node's CPU
# (-march=native, so never at build time) with g++ and the pip-installed ninja; without g++ the
# slower torch implementations would serve.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc g++ libc6-dev \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/*
# Then the other requirements, then the project's wheel: a source change rebuilds only that
# last small layer. The stubs' import checks their grpcio and protobuf against the venv's.
COPY --from=build /src/requirements.txt /tmp/build/
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf \
    pip install -r /tmp/build/requirements.txt \
 && rm -rf /tmp/build
COPY --from=build /wheels/ /tmp/build/
RUN pip install --no-deps /tmp/build/*.whl \
 && rm -rf /tmp/build \
 && pip check \
 && python -c "import common.wire.pb.executor_pb2_grpc"
LABEL org.opencontainers.image.title="tandem-executor-gpu" \
      org.opencontainers.image.description="Tandem GPU executor (CUDA torch, gRPC)" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
# Made above: WORKDIR alone does not create it with every builder (podman's buildah).
WORKDIR /opt/tandem
USER 10001:10001
EXPOSE 50051
ENTRYPOINT ["python", "-m", "executor_gpu"]
