# syntax=docker/dockerfile:1
# Tandem GPU executor: CUDA torch (PyPI's torch wheels carry the CUDA libraries; the node's
# driver comes in through the NVIDIA container runtime).
# Build from the repository root: docker build -f docker/executor-gpu.Dockerfile -t tandem/executor-gpu .

# The base image: the official Python image by default; the image tests build from a local
# Debian bookworm base with the same Python (scripts/build_base_image.sh) where no registry is
# reachable.
ARG BASE_IMAGE=python:3.11.13-slim-bookworm

FROM ${BASE_IMAGE} AS build
# pip's index, extra index and CA bundle when not PyPI's (a mirror): unset by default, and
# build arguments of this stage only, so nothing of the build host reaches the runtime image.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml docker/pyproject_requirements.py ./
# Which torch: unset, the gpu extra's pin from PyPI (the CUDA build). A CPU-only image (CPU
# nodes, tests), either TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu (its 2.9.0+cpu
# meets the pin), or TORCH naming another torch, e.g. TORCH=torch==2.13.0+cpu, with
# PIP_FIND_LINKS where pip finds its wheel (a URL, or a folder the build mounts: podman build
# -v DIR:DIR:ro). The project itself is installed without its pins (--no-deps) after the
# requirements printed from pyproject.toml: TORCH replaces the pin and nothing else.
ARG TORCH
ARG TORCH_INDEX_URL
ARG PIP_FIND_LINKS
# torch alone first: its layer (GBs with CUDA) is built once per pin, not once per source change,
# and shared with the TPU image (executor-tpu.Dockerfile has the same lines up to here).
RUN python pyproject_requirements.py --only-torch --torch "$TORCH" >torch.txt \
 && pip install ${TORCH_INDEX_URL:+--extra-index-url=$TORCH_INDEX_URL} -r torch.txt
RUN python pyproject_requirements.py gpu --torch "$TORCH" >requirements.txt \
 && pip install -r requirements.txt
COPY proto ./proto
COPY common ./common
COPY executor_gpu ./executor_gpu
# The gRPC stubs are generated here (they are never tracked), with the grpcio the image keeps.
RUN pip install "grpcio-tools>=1.66" \
 && python -m grpc_tools.protoc -Icommon/wire/pb=proto --python_out=. --grpc_python_out=. proto/executor.proto \
 && pip install --no-deps . \
 && pip uninstall -y grpcio-tools \
 && pip check

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="tandem-executor-gpu" \
      org.opencontainers.image.description="Tandem GPU executor (CUDA torch, gRPC)" \
      org.opencontainers.image.licenses="Apache-2.0"
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
RUN groupadd --system --gid 10001 tandem \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin tandem \
 && mkdir -p /opt/tandem
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
# Made above: WORKDIR alone does not create it with every builder (podman's buildah).
WORKDIR /opt/tandem
USER 10001:10001
EXPOSE 50051
ENTRYPOINT ["python", "-m", "executor_gpu"]
