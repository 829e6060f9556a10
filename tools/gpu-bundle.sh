#!/usr/bin/env bash
# The real node's parts for a GPU machine that reaches no network (tests/gpu/test_pod_on_gpu.py,
# tests/gpu/test_dra_gpu.py): the control plane's and the kubelet's binaries (Kubernetes 1.36), helm,
# containerd 2 (with CDI, for DRA), runc and the CNI plugins, the
# Python packages the product needs beyond what that machine's Python has, and the pause image.
# Made here, in two parts of under 64 MiB each (what one call to such a machine may carry), and
# unpacked there into $VGPU_STAGE (default /tmp/vgpu-stage), part by part.
#
#   tools/gpu-bundle.sh make          # here: .cache/gpu-a and .cache/gpu-b
#   tools/gpu-bundle.sh stage a|b     # there: unpack that part (from $VGPU_BUNDLE_DIR/gpu-a|b,
#                                     # default .cache/gpu-a|b) into $VGPU_STAGE
#   tools/gpu-bundle.sh env           # there: the exports that run the sandbox from $VGPU_STAGE
#
# How it is made: the Go binaries are already stripped (-s -w), so each is compressed on its own
# with xz -7 (kube, the multi-call kube-apiserver/controller-manager/scheduler/kubectl: 123 MB ->
# 24 MB); containerd 2, containerd-shim-runc-v2 and ctr (tools/build.sh containerd, from
# $VGPU_BIN_DIR/current) go into one tar.xz and are staged into $VGPU_STAGE/bin/current, where the
# real node looks for them (vgpu_sandbox.realnode.prechecks.CONTAINERD_BINARIES); runc (Debian's package,
# unpacked, found on PATH) and the CNI bridge/host-local/loopback plugins go into another; the wheels (pip download for Python 3.12,
# manylinux x86_64) are installed into a folder here, without kubernetes' asyncio client, and
# that folder goes into one tar.xz (33 MB of wheels -> 12 MB). KWOK and crictl stay behind: the
# real-GPU sandbox runs no simulated nodes (--nodes 0) and needs no crictl. Each part carries
# versions.txt (the bundle's layout and what its binaries say they are); a make over a part without
# it (an older bundle) or with other binaries makes that part again, keeping only the wheels.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
stage=${VGPU_STAGE:-/tmp/vgpu-stage}
bins=${VGPU_BIN_DIR:-$repo/.cache/bin}/current
images=${VGPU_IMAGE_DIR:-$repo/.cache/images}
debs=${VGPU_DEBS:-$repo/.debs}
work=${VGPU_BUNDLE_WORK:-/tmp/vgpu-bundle-work}
# The product's dependencies that the GPU machine's Python (3.12) lacks or has too old.
WHEELS=(flask==3.1.3 itsdangerous==2.2.0 blinker==1.9.0 gunicorn==27.0.1 kubernetes==37.0.2
  durationpy==0.11 orjson==3.13.0 websocket-client==1.9.2 requests-oauthlib==2.0.0 oauthlib==4.0.1
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 urllib3==2.8.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
  grpcio==1.85.3 protobuf==7.36.2)
# 2: containerd 2 from \$VGPU_BIN_DIR (containerd.tar.xz), runtime.tar.xz only runc and the CNI
# 3: helm in part b (the sandbox installs the chart with helm)
LAYOUT=3
# containerd 2's binaries, staged beside the kubelet (vgpu_sandbox.realnode.prechecks.CONTAINERD_BINARIES)
CONTAINERD=(containerd containerd-shim-runc-v2 ctr)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

log() { printf 'gpu-bundle: %s\n' "$*" >&2; }
die() {
  log "FAILED: $*"
  exit 1
}

# $1 output, rest: the command that writes it to stdout; skipped when the output is there
made() {
  local out=$1
  shift
  if [ -s "$out" ]; then
    log "kept $out"
    return
  fi
  "$@" >"$out.tmp" && mv "$out.tmp" "$out"
  log "made $out ($(du -h "$out" | cut -f1))"
}

make_bundle() {
  local a=$repo/.cache/gpu-a b=$repo/.cache/gpu-b
  mkdir -p "$a" "$b" "$work"
  for name in kube kubelet etcd helm "${CONTAINERD[@]}"; do
    [ -x "$bins/$name" ] || die "$bins/$name is missing: tools/build.sh (or point VGPU_BIN_DIR at the 1.36 cache)"
  done
  local versions
  versions=$(echo "layout $LAYOUT" && "$bins/kubelet" --version && "$bins/containerd" --version &&
    "$bins/etcd" --version | sed -n 1p)
  for part in "$a" "$b"; do
    if [ "$(cat "$part/versions.txt" 2>/dev/null)" != "$versions" ]; then
      log "$part is not from these binaries or this layout: making it again (the wheels kept)"
      find "$part" -maxdepth 1 -type f ! -name site.tar.xz -delete
    fi
    printf '%s\n' "$versions" >"$part/versions.txt"
  done
  log "binaries: $(echo "$versions" | tr '\n' ';')"
  made "$a/kube.xz" xz -7 -T2 -c "$bins/kube"
  made "$a/kubelet.xz" xz -7 -T2 -c "$bins/kubelet"
  made "$b/etcd.xz" xz -7 -T2 -c "$bins/etcd"
  made "$b/helm.xz" xz -7 -T2 -c "$bins/helm"
  made "$b/containerd.tar.xz" bash -c "tar -C '$bins' -chf - ${CONTAINERD[*]} | xz -7 -T2"
  if [ ! -s "$a/site.tar.xz" ]; then
    mkdir -p "$work/wheels"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${PLATFORMS[@]}" -d "$work/wheels" "${WHEELS[@]}"
    rm -rf "$work/site"
    python3 -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 \
      --implementation cp "${PLATFORMS[@]}" --target "$work/site" "$work"/wheels/*.whl
    rm -rf "$work/site/kubernetes/aio" "$work/site/bin"
    find "$work/site" -name __pycache__ -prune -exec rm -rf {} +
  fi
  made "$a/site.tar.xz" bash -c "tar -C '$work/site' -cf - . | xz -7 -T2"
  cp "$images/pause.tar" "$a/pause.tar"
  if [ ! -s "$b/runtime.tar.xz" ]; then
    rm -rf "$work/root"
    mkdir -p "$work/root/cni"
    for deb in "$debs"/runc_*.deb; do
      [ -f "$deb" ] || die "no $deb: apt-get download runc into $debs"
      dpkg-deb -x "$deb" "$work/root"
    done
    cp /usr/lib/cni/bridge /usr/lib/cni/host-local /usr/lib/cni/loopback "$work/root/cni/"
  fi
  made "$b/runtime.tar.xz" bash -c "tar -C '$work/root' -cf - usr/sbin/runc cni | xz -7 -T2"
  # iproute2's ip with its libraries, for a machine image without it (used only where ip is missing)
  if [ ! -s "$b/iproute.tar.xz" ]; then
    rm -rf "$work/iproute" && mkdir -p "$work/iproute"
    cp "$(readlink -f "$(command -v ip)")" "$work/iproute/ip"
    for lib in $(ldd "$work/iproute/ip" | awk '/=>/ {print $3}' | grep -Ev '/(libc|libz|libm)\.so'); do
      cp "$(readlink -f "$lib")" "$work/iproute/$(basename "$lib")"
    done
  fi
  made "$b/iproute.tar.xz" bash -c "tar -C '$work' -cf - iproute | xz -7"
  for part in "$a" "$b"; do
    (cd "$part" && rm -f SHA256SUMS && sha256sum ./* >SHA256SUMS.tmp && mv SHA256SUMS.tmp SHA256SUMS)
  done
  local part size
  for part in "$a" "$b"; do
    size=$(du -sb "$part" | cut -f1)
    [ "$size" -lt $((64 << 20)) ] || die "$part is $((size >> 20)) MiB: over the 64 MiB one call may carry"
    log "$part: $((size >> 20)) MiB ($size bytes)"
  done
}

stage_part() {
  local part=$1 src=${VGPU_BUNDLE_DIR:-$repo/.cache}/gpu-$1
  [ -d "$src" ] || die "$src is not here: carry .cache/gpu-$part"
  (cd "$src" && sha256sum -c --quiet SHA256SUMS) || die "part $part arrived damaged"
  mkdir -p "$stage/bin/current" "$stage/site" "$stage/images" "$stage/root"
  if [ "$part" = a ]; then
    xz -dc "$src/kube.xz" >"$stage/bin/kube"
    xz -dc "$src/kubelet.xz" >"$stage/bin/current/kubelet"
    chmod +x "$stage/bin/kube" "$stage/bin/current/kubelet"
    for name in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
      ln -sf ../kube "$stage/bin/current/$name"
    done
    tar -xJf "$src/site.tar.xz" -C "$stage/site"
    cp "$src/pause.tar" "$stage/images/pause.tar"
    printf '{"pause": {"ref": "registry.k8s.io/pause:3.10", "file": "%s"}}\n' \
      "$stage/images/pause.tar" >"$stage/images/images.json"
  else
    xz -dc "$src/etcd.xz" >"$stage/bin/current/etcd"
    xz -dc "$src/helm.xz" >"$stage/bin/current/helm"
    chmod +x "$stage/bin/current/etcd" "$stage/bin/current/helm"
    tar -xJf "$src/containerd.tar.xz" -C "$stage/bin/current"
    tar -xJf "$src/runtime.tar.xz" -C "$stage/root"
    tar -xJf "$src/iproute.tar.xz" -C "$stage"
    mkdir -p "$stage/fallback"
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/iproute exec %s/iproute/ip "$@"\n' "$stage" "$stage" >"$stage/fallback/ip"
    chmod +x "$stage/fallback/ip"
    if [ ! -x /usr/lib/cni/bridge ] && [ ! -x /opt/cni/bin/bridge ]; then
      mkdir -p /opt/cni/bin && cp "$stage/root/cni/"* /opt/cni/bin/
    fi
  fi
  touch "$stage/$part.ok"
  log "part $part staged in $stage"
}

print_env() {
  cat <<EOF
export PATH=$stage/root/usr/sbin:\$PATH:$stage/fallback
export PYTHONPATH=$stage/site:$repo:$repo/sandbox
export VGPU_BIN_DIR=$stage/bin
export VGPU_IMAGE_DIR=$stage/images
EOF
}

case "${1:-}" in
  make) make_bundle ;;
  stage) stage_part "${2:?a or b}" ;;
  env) print_env ;;
  *) die "usage: tools/gpu-bundle.sh make | stage a|b | env" ;;
esac
