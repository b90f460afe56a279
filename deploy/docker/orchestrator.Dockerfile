# syntax=docker/dockerfile:1.7
# specdec orchestrator: the public API. CPU only and without torch: the
# project is installed with --no-deps on top of orchestrator-requirements.txt,
# and the entry point is `python -m specdec.cli.stack`, the orchestrator's
# command without the rest of the CLI (whose other subcommands import torch).
#
# Build from the repository root:
#   docker build -f deploy/docker/orchestrator.Dockerfile -t registry.example.com/specdec/orchestrator:0.1.0 .
# No HEALTHCHECK: Kubernetes probes the gRPC health service instead.

ARG PYTHON_IMAGE=python:3.12.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/specdec
ENV PATH=/opt/specdec/bin:$PATH
WORKDIR /src
COPY deploy/docker/orchestrator-requirements.txt ./
RUN pip install -r orchestrator-requirements.txt
COPY pyproject.toml README.md ./
COPY specdec ./specdec
COPY drafter ./drafter
COPY verifier ./verifier
COPY orchestrator ./orchestrator
# The --help run fails the build if the orchestrator's command needs torch.
RUN pip install --no-deps . \
 && if python -c "import torch" 2> /dev/null; then echo "torch must not be in this image" >&2; exit 1; fi \
 && python -m specdec.cli.stack orchestrator serve --help > /dev/null

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 specdec \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin specdec
COPY --from=build /opt/specdec /opt/specdec
ENV PATH=/opt/specdec/bin:$PATH \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HUB_OFFLINE=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SPECDEC_HOST=0.0.0.0 \
    SPECDEC_PORT=50051 \
    SPECDEC_METRICS_PORT=9090
USER 10001:10001
EXPOSE 50051 9090
ENTRYPOINT ["python", "-m", "specdec.cli.stack"]
CMD ["orchestrator", "serve"]
