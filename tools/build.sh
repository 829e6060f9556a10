#!/usr/bin/env bash
# Builds the sandbox's binaries from the Go module proxy (and etcd from Debian's
# package) into a cache keyed by version. Builds only what is missing.
#
#   tools/build.sh [kube|kubelet|containerd|crictl|nvidia-ctk|kwok|helm|etcd|ocipack]...   (default: etcd kwok helm kube ocipack)
#
# VGPU_BIN_DIR picks the cache (default: <repo>/.cache/bin). Each piece lands in
# $VGPU_BIN_DIR/<piece>-<version>/ and is linked from $VGPU_BIN_DIR/current/.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
# shellcheck source=versions.env
. "$here/versions.env"
bin_dir=${VGPU_BIN_DIR:-$repo/.cache/bin}
mkdir -p "$bin_dir/current"
# -buildvcs=false: the versions go in with -ldflags, and stamping the clone's git state would make
# `sudo make test` in a clone that a plain user owns fail (git refuses a repository of another
# owner: "error obtaining VCS status").
export CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false" GOTOOLCHAIN=local

log() { printf 'setup: %s\n' "$*" >&2; }

# done_or_build NAME VERSION BUILD_FUNCTION: runs the build into a temp folder
# and moves it into place only when it succeeded, so a broken build never
# leaves a half-filled cache entry.
build_once() {
  local name=$1 version=$2 fn=$3 dest="$bin_dir/$1-$2"
  if [ -f "$dest/.complete" ]; then
    log "$name $version: cached in $dest"
  else
    log "$name $version: building (first time only)"
    local tmp; tmp=$(mktemp -d "$bin_dir/.$name-XXXXXX"); chmod 755 "$tmp"
    local start=$SECONDS
    if ! "$fn" "$tmp" "$version"; then
      rm -rf "$tmp"
      log "$name $version: build FAILED; see the output above"
      return 1
    fi
    touch "$tmp/.complete"
    rm -rf "$dest"; mv "$tmp" "$dest"
    log "$name $version: built in $((SECONDS - start))s"
  fi
  local f
  for f in "$dest"/*; do ln -sfn "$f" "$bin_dir/current/$(basename "$f")"; done
}

build_kube() {
  local out=$1 v=$2 minor=${2#v1.}; minor=${minor%%.*}
  local date; date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  local ld="-s -w"
  local pkg
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld="$ld -X $pkg.gitVersion=$v -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean -X $pkg.buildDate=$date"
  done
  (cd "$here/kube" && go build -trimpath -pgo=off -ldflags "$ld" -o "$out/kube" .) || return 1
  local p
  for p in kube-apiserver kube-controller-manager kube-scheduler kubectl; do ln -s kube "$out/$p"; done
}

# The kubelet of the sandbox's real node (`vgpu sandbox up --real-node`), at the control plane's
# pin; its own module (tools/kubelet) so its dependencies never move the control plane's.
build_kubelet() {
  local out=$1 v=$2 minor=${2#v1.}; minor=${minor%%.*}
  local date; date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  local ld="-s -w" pkg
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld="$ld -X $pkg.gitVersion=$v -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean -X $pkg.buildDate=$date"
  done
  (cd "$here/kubelet" && go build -trimpath -pgo=off -ldflags "$ld" -o "$out/kubelet" .)
}

# containerd 2 for the sandbox's real node: containerd, its runc shim and ctr, from their own
# module (tools/containerd). Debian's containerd (1.6) has no CDI, which DRA drivers hand devices to
# containers through. Without cgo, and without the snapshotters that need it or a kernel module
# (btrfs, devmapper, zfs): the node uses overlayfs or native. The shim drops gRPC as upstream's
# static build does. runc stays Debian's.
build_containerd() {
  local pkg=github.com/containerd/containerd/v2 tags="no_btrfs no_devmapper no_zfs urfave_cli_no_docs"
  local ld="-s -w -X $pkg/version.Version=$2 -X $pkg/version.Package=$pkg -X $pkg/version.Revision=module"
  (cd "$here/containerd" &&
    go build -trimpath -tags "$tags" -ldflags "$ld" -o "$1/containerd" $pkg/cmd/containerd &&
    go build -trimpath -tags "$tags" -ldflags "$ld" -o "$1/ctr" $pkg/cmd/ctr &&
    go build -trimpath -tags "$tags no_grpc" -ldflags "$ld" -o "$1/containerd-shim-runc-v2" \
      $pkg/cmd/containerd-shim-runc-v2)
}

# crictl, to stop and remove the real node's pod sandboxes through the CRI.
build_crictl() {
  (cd "$here/crictl" && go build -trimpath -ldflags "-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=$2" \
     -o "$1/crictl" sigs.k8s.io/cri-tools/cmd/crictl)
}

# NVIDIA's nvidia-ctk, which roles/gpu_node runs on the real node, and nvidia-container-runtime,
# which the role makes containerd's default runtime there (in CDI mode: no libnvidia-container).
# go-nvml needs cgo.
build_nvidia_ctk() {
  local cmd
  for cmd in nvidia-ctk nvidia-container-runtime; do
    (cd "$here/nvidia-ctk" && CGO_ENABLED=1 go build -trimpath -ldflags "-s -w" -o "$1/$cmd" \
       "github.com/NVIDIA/nvidia-container-toolkit/cmd/$cmd") || return 1
  done
}

build_kwok() {
  (cd "$here/kwok" && go build -trimpath -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=$2" -o "$1/kwok" sigs.k8s.io/kwok/cmd/kwok)
}

build_helm() {
  local kminor=${KUBE_VERSION#v1.}; kminor=${kminor%%.*}
  local ld="-s -w -X helm.sh/helm/v3/internal/version.version=${2%%+*}"
  ld="$ld -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$kminor"
  ld="$ld -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$kminor"
  (cd "$here/helm" && go build -trimpath -ldflags "$ld" -o "$1/helm" helm.sh/helm/v3/cmd/helm)
}

# ocipack (our docker-archive writer, tools/ocipack/main.go) and crane, both from
# go-containerregistry; tools/images.sh packs the images with ocipack. The cache key carries a
# hash of tools/ocipack/ too, since its main.go is ours and changes without a version bump.
build_ocipack() {
  (cd "$here/ocipack" && go build -trimpath -ldflags "-s -w" -o "$1/ocipack" . &&
    go build -trimpath -ldflags "-s -w" -o "$1/crane" github.com/google/go-containerregistry/cmd/crane)
}

ocipack_version() {
  local h; h=$(cd "$here/ocipack" && cat go.mod go.sum ./*.go | sha256sum | cut -c1-8)
  printf '%s-%s' "$GGCR_VERSION" "$h"
}

build_etcd() {
  local out=$1 v=$2 work; work=$(mktemp -d)
  # apt-get download needs package lists; fetch them once if this machine has none.
  if ! (cd "$work" && apt-get download "etcd-server=$v" >/dev/null 2>&1); then
    apt-get update >/dev/null 2>&1 || true
    (cd "$work" && apt-get download "etcd-server=$v") || {
      log "etcd: could not download Debian's etcd-server $v; check that apt-get reaches Debian's packages"
      rm -rf "$work"; return 1; }
  fi
  dpkg-deb -x "$work"/etcd-server_*.deb "$work/root" || { rm -rf "$work"; return 1; }
  cp "$work/root/usr/bin/etcd" "$out/etcd"
  rm -rf "$work"
}

pieces=("$@")
[ ${#pieces[@]} -gt 0 ] || pieces=(etcd kwok helm kube ocipack)
for p in "${pieces[@]}"; do
  case $p in
    kube) build_once kube "$KUBE_VERSION" build_kube ;;
    kubelet) build_once kubelet "$KUBE_VERSION" build_kubelet ;;
    containerd) build_once containerd "$CONTAINERD_VERSION" build_containerd ;;
    crictl) build_once crictl "$CRICTL_VERSION" build_crictl ;;
    # +runtime: the piece gained nvidia-container-runtime; caches of nvidia-ctk alone build again
    nvidia-ctk) build_once nvidia-ctk "$NVIDIA_CTK_VERSION+runtime" build_nvidia_ctk ;;
    kwok) build_once kwok "$KWOK_VERSION" build_kwok ;;
    # helm's default cluster version (helm template, helm lint) is baked in from KUBE_VERSION's
    # minor: a new pin must build a new helm, not reuse the cached one
    helm) build_once helm "$HELM_VERSION+kube${KUBE_VERSION#v}" build_helm ;;
    etcd) build_once etcd "$ETCD_DEB_VERSION" build_etcd ;;
    ocipack) build_once ocipack "$(ocipack_version)" build_ocipack ;;
    *) log "unknown piece '$p'; choose from kube kubelet containerd crictl nvidia-ctk kwok helm etcd ocipack"; exit 2 ;;
  esac
done
log "binaries in $bin_dir/current"
