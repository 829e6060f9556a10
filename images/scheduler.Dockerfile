# syntax=docker/dockerfile:1
# The scheduler image: the `vgpu` command (extender, webhook, scheduler metrics). The chart runs
# it beside the upstream kube-scheduler image, in the same pod, as uid 65532.
#
#   docker build -f images/scheduler.Dockerfile -t docker.io/vgpu/scheduler:dev .     (from the repo root)
#
# `make images-docker` builds both (`IMAGE_TAG=0.1.0` for another tag than dev). The chart pulls
# docker.io/vgpu/scheduler (scheduler.extender.image); nobody publishes it yet, so push it to your registry
# (docs/install.md, "Images").
#
# Bases are pinned to exact tags; pin digests too where your registry policy asks for them.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml requirements.lock ./
COPY vgpu ./vgpu
# A self-contained virtual environment; nothing of the build stage reaches the final image.
RUN python -m venv /opt/vgpu \
 && /opt/vgpu/bin/pip install --no-cache-dir --no-compile -c requirements.lock . \
 && /opt/vgpu/bin/python -m compileall -q /opt/vgpu/lib

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="vgpu-scheduler" \
      org.opencontainers.image.description="vgpu scheduler extender and admission webhook" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/vgpu /opt/vgpu
ENV PATH=/opt/vgpu/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Non-root: the extender only serves HTTPS on an unprivileged port and talks to the API server.
USER 65532:65532
ENTRYPOINT ["vgpu"]
CMD ["extender", "--help"]
