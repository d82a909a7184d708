# syntax=docker/dockerfile:1
# ome-gateway-publisher: the sidecar image. Two stages: `build` turns the source tree and its
# dependencies into wheels; the runtime stage installs those wheels from a bind mount, so neither
# the wheels nor any build tooling end up in the final image.
# Build: docker build -t ome-gateway-publisher .
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY publisher ./publisher
COPY adapters ./adapters
# The project's wheel plus a wheel for every runtime dependency, the xDS server's (grpcio,
# xds-protos: Envoy's default mode in the chart) included; all of them publish binary wheels for
# CPython 3.11 on amd64 and arm64, so no compiler is needed even here.
RUN pip wheel --no-cache-dir --wheel-dir /wheels '.[xds]'

FROM ${PYTHON_IMAGE}
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index /wheels/*.whl
# A fixed numeric UID, so Kubernetes' runAsNonRoot can verify it without a passwd lookup.
USER 10001:10001
WORKDIR /tmp
ENTRYPOINT ["ome-publisher"]
