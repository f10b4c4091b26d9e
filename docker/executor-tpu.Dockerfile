# syntax=docker/dockerfile:1
# Tandem TPU executor: torch + torch_xla with libtpu (torch_xla's "tpu" extra), PJRT on TPU.
# Build from the repository root: docker build -f docker/executor-tpu.Dockerfile -t tandem/executor-tpu .

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
# Which torch: unset, the tpu extra's pin from PyPI, which is the CUDA build and brings ~3 GB of
# NVIDIA libraries a TPU never uses; TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu gives
# 2.9.0+cpu instead, which meets torch_xla's pin. TORCH (another torch, found through the
# pip.conf secret) is here for the layer shared with the GPU image: torch_xla needs exactly
# torch 2.9.0. Arguments of this stage only: the final stage gets their effect through torch.txt.
ARG TORCH
ARG TORCH_INDEX_URL
RUN python pyproject_requirements.py --only-torch --torch "$TORCH" >torch.txt \
 && if [ -n "$TORCH_INDEX_URL" ]; then echo "--extra-index-url $TORCH_INDEX_URL" >>torch.txt; fi \
 && python pyproject_requirements.py tpu --torch "$TORCH" >requirements.txt
COPY proto ./proto
COPY common ./common
COPY executor_tpu ./executor_tpu
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
# change, and shared with the GPU image (executor-gpu.Dockerfile has the same lines up to here).
COPY --from=build /src/torch.txt /tmp/build/
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf \
    python -m venv /opt/venv \
 && pip install -r /tmp/build/torch.txt
# torch_xla must match torch's version (pyproject's tpu extra pins both); [tpu] adds libtpu.
# Then the project's wheel: a source change rebuilds only that last small layer. torch_xla's
# wheel does not name its torch, so pip check cannot see a mismatch: importing it does (an
# undefined symbol of torch's when TORCH is not 2.9.0). The stubs' import checks their grpcio
# and protobuf against the venv's.
COPY --from=build /src/requirements.txt /tmp/build/
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf \
    pip install -r /tmp/build/requirements.txt "torch_xla[tpu]==2.9.0" \
 && rm -rf /tmp/build
COPY --from=build /wheels/ /tmp/build/
RUN pip install --no-deps /tmp/build/*.whl \
 && rm -rf /tmp/build \
 && python -c "import common.wire.pb.executor_pb2_grpc" \
 && pip check \
 && python -c "import torch_xla"
LABEL org.opencontainers.image.title="tandem-executor-tpu" \
      org.opencontainers.image.description="Tandem TPU executor (torch_xla, libtpu, gRPC)" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp PJRT_DEVICE=TPU
# Made above: WORKDIR alone does not create it with every builder (podman's buildah).
WORKDIR /opt/tandem
# Non-root by default; on nodes whose TPU device files only root may open, the chart's tpu
# pool runs the container as uid 0 (values: tpu.securityContext).
USER 10001:10001
EXPOSE 50051
ENTRYPOINT ["python", "-m", "executor_tpu"]
