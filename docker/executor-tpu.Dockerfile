# syntax=docker/dockerfile:1
# Tandem TPU executor: torch + torch_xla with libtpu (torch_xla's "tpu" extra), PJRT on TPU.
# Build from the repository root: docker build -f docker/executor-tpu.Dockerfile -t tandem/executor-tpu .

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
# Which torch: unset, the tpu extra's pin from PyPI, which is the CUDA build and brings ~3 GB of
# NVIDIA libraries a TPU never uses; TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu gives
# 2.9.0+cpu instead, which meets torch_xla's pin. TORCH (another torch, with PIP_FIND_LINKS) is
# here for the layer shared with the GPU image: torch_xla needs exactly torch 2.9.0.
ARG TORCH
ARG TORCH_INDEX_URL
ARG PIP_FIND_LINKS
# torch alone first: its layer (GBs with CUDA) is built once per pin, not once per source change,
# and shared with the GPU image (executor-gpu.Dockerfile has the same lines up to here).
RUN python pyproject_requirements.py --only-torch --torch "$TORCH" >torch.txt \
 && pip install ${TORCH_INDEX_URL:+--extra-index-url=$TORCH_INDEX_URL} -r torch.txt
# torch_xla must match torch's version (pyproject's tpu extra pins both); [tpu] adds libtpu.
RUN python pyproject_requirements.py tpu --torch "$TORCH" >requirements.txt \
 && pip install -r requirements.txt "torch_xla[tpu]==2.9.0"
COPY proto ./proto
COPY common ./common
COPY executor_tpu ./executor_tpu
# The gRPC stubs are generated here (they are never tracked), with the grpcio the image keeps.
# torch_xla's wheel does not name its torch, so pip check cannot see a mismatch: importing it
# does (an undefined symbol of torch's when TORCH is not 2.9.0).
RUN pip install "grpcio-tools>=1.66" \
 && python -m grpc_tools.protoc -Icommon/wire/pb=proto --python_out=. --grpc_python_out=. proto/executor.proto \
 && pip install --no-deps . \
 && pip uninstall -y grpcio-tools \
 && pip check \
 && python -c "import torch_xla"

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="tandem-executor-tpu" \
      org.opencontainers.image.description="Tandem TPU executor (torch_xla, libtpu, gRPC)" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 tandem \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin tandem \
 && mkdir -p /opt/tandem
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp \
    PJRT_DEVICE=TPU
# Made above: WORKDIR alone does not create it with every builder (podman's buildah).
WORKDIR /opt/tandem
# Non-root by default; on nodes whose TPU device files only root may open, the chart's tpu
# pool runs the container as uid 0 (values: tpu.securityContext).
USER 10001:10001
EXPOSE 50051
ENTRYPOINT ["python", "-m", "executor_tpu"]
