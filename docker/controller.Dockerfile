# syntax=docker/dockerfile:1
# Tandem controller: OpenAI-compatible HTTP API, scheduling, KV-cache allocation. No torch.
# Build from the repository root: docker build -f docker/controller.Dockerfile -t tandem/controller .

# The base image: the official Python image by default; the image tests build from a local
# Debian bookworm base with the same Python (scripts/build_base_image.sh) where no registry is
# reachable.
ARG BASE_IMAGE=python:3.11.13-slim-bookworm

FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml ./
COPY proto ./proto
COPY common ./common
COPY controller ./controller
# The gRPC stubs are generated here (they are never tracked), with the grpcio the image keeps.
# pip's index, mirror or CA bundle come from an optional build secret, a pip.conf (podman/docker
# build --secret id=pip.conf,src=FILE): never in a layer or the image history.
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf \
    pip install "grpcio-tools>=1.66" \
 && python -m grpc_tools.protoc -Icommon/wire/pb=proto --python_out=. --grpc_python_out=. proto/executor.proto \
 && pip install ".[controller]" \
 && pip uninstall -y grpcio-tools

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="tandem-controller" \
      org.opencontainers.image.description="Tandem controller: OpenAI-compatible endpoint in front of GPU/TPU executors" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 tandem \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin tandem \
 && mkdir -p /opt/tandem
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
# Made above: WORKDIR alone does not create it with every builder (podman's buildah).
WORKDIR /opt/tandem
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["python", "-m", "controller"]
