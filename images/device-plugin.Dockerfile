# syntax=docker/dockerfile:1
# The device plugin image: the `vgpu` command (device plugin and node monitor) and the native
# hook library at /usr/local/vgpu/libvgpu.so, which the plugin copies to the host at start
# (/var/lib/vgpu/lib/<content hash>/, never over a library in use).
#
#   docker build -f images/device-plugin.Dockerfile -t docker.io/vgpu/device-plugin:dev .   (from the repo root)
#
# `make images-docker` builds both (`IMAGE_TAG=0.1.0` for another tag than dev). The chart pulls
# docker.io/vgpu/device-plugin (devicePlugin.image); nobody publishes it yet, so push it to your registry
# (docs/install.md, "Images").
#
# Bases are pinned to exact tags; pin digests too where your registry policy asks for them.
#
# The hook is preloaded into every GPU container, whatever its distribution, so it is built on
# the oldest glibc still in wide use (CentOS 7's 2.17, the manylinux2014 image, gcc from
# devtoolset): a library built on a newer glibc would fail to preload in older images and leave
# their processes without limits. For arm64 pass
# --build-arg HOOK_BUILDER=quay.io/pypa/manylinux2014_aarch64:2024-03-10-4935fcc.
ARG HOOK_BUILDER=quay.io/pypa/manylinux2014_x86_64:2024-03-10-4935fcc
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${HOOK_BUILDER} AS hook
# The version string the hook logs (`make images-docker` passes the image's tag).
ARG HOOK_VERSION=dev
WORKDIR /src/native/hook
COPY native/hook ./
RUN make clean && make build/libvgpu.so HOOK_VERSION="${HOOK_VERSION}" && install -D -m 0755 build/libvgpu.so /out/libvgpu.so

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml requirements.lock ./
COPY vgpu ./vgpu
RUN python -m venv /opt/vgpu \
 && /opt/vgpu/bin/pip install --no-cache-dir --no-compile -c requirements.lock . \
 && /opt/vgpu/bin/python -m compileall -q /opt/vgpu/lib

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="vgpu-device-plugin" \
      org.opencontainers.image.description="vgpu device plugin, node monitor and hook library" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/vgpu /opt/vgpu
COPY --from=hook /out/libvgpu.so /usr/local/vgpu/libvgpu.so
ENV PATH=/opt/vgpu/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VGPU_HOOK_LIBRARY=/usr/local/vgpu/libvgpu.so
# Root, without privileges (the chart drops every capability): the plugin serves its socket in
# the kubelet's root-owned directory and writes under the root-owned /var/lib/vgpu.
USER 0:0
ENTRYPOINT ["vgpu"]
CMD ["device-plugin", "--help"]
