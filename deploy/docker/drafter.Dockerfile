# syntax=docker/dockerfile:1.7
# specdec drafter: the draft model's service (EAGLE head, small LM or n-gram),
# for one NVIDIA GPU.
#
# Build from the repository root:
#   docker build -f deploy/docker/drafter.Dockerfile -t registry.example.com/specdec/drafter:0.1.0 .
# torch comes from TORCH_SPEC: the default wheel from the package index bundles
# its CUDA runtime, so the base image needs only the driver hooks of an
# nvidia/cuda "base" image. A CPU-only image (the dev-cpu overlay):
#   --build-arg TORCH_SPEC=torch==2.13.0+cpu --build-arg TORCH_INDEX_URL=<a CPU wheel index>
# No HEALTHCHECK: Kubernetes probes the gRPC health service instead.

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/specdec
ENV PATH=/opt/specdec/bin:$PATH
# torch first, in its own layer: it is most of the image and changes rarely.
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY specdec ./specdec
COPY drafter ./drafter
COPY verifier ./verifier
COPY orchestrator ./orchestrator
RUN pip install . \
 && specdec drafter serve --help > /dev/null

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# A C++ compiler and the Python headers: inductor builds the compiled forwards
# (--compile, SPECDEC_COMPILE) at start-up; without them they run eagerly.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 g++ python3-dev \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 specdec \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin specdec
COPY --from=build /opt/specdec /opt/specdec
# Read-only root filesystem in the cluster: every cache goes to /tmp (an
# emptyDir), and nothing is fetched from a model hub at run time.
ENV PATH=/opt/specdec/bin:$PATH \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/tmp/hf \
    HF_HUB_OFFLINE=1 \
    TRITON_CACHE_DIR=/tmp/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor \
    MPLCONFIGDIR=/tmp/matplotlib \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SPECDEC_HOST=0.0.0.0 \
    SPECDEC_PORT=50051 \
    SPECDEC_METRICS_PORT=9090
USER 10001:10001
EXPOSE 50051 9090
ENTRYPOINT ["specdec"]
CMD ["drafter", "serve"]
