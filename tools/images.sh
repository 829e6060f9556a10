#!/usr/bin/env bash
# Builds the project's container images without a container engine or a registry: a Debian root
# file system from debootstrap is the first layer of every image, the rest are tarballs made
# here, and ocipack (tools/ocipack, on go-containerregistry) writes each image as a
# docker-archive that `ctr -n k8s.io images import FILE` names by its reference.
# images/*.Dockerfile say what the images hold; docs/images.md says how these differ.
#
#   tools/images.sh [device-plugin|scheduler|kube-scheduler|sample|pause]...   (default: all five)
#
# The images are named as the chart names them, docker.io/vgpu/<name>, tagged dev, or
# $VGPU_IMAGE_TAG (make images IMAGE_TAG=0.1.0). kube-scheduler is the chart's other scheduler
# container: upstream's kube-scheduler at the cluster's version (KUBE_VERSION in
# tools/versions.env), named as registry.k8s.io names it, from the multi-call `kube` binary
# tools/build.sh builds.
#
# Writes ${VGPU_IMAGE_DIR:-<repo>/.cache/images}/<name>.tar (a stamp beside each: an image is
# rebuilt only when what it packs changed) and images.json. The Debian base, the dependency
# wheels and ocipack are cached by their inputs under ${VGPU_BIN_DIR:-<repo>/.cache/bin}.
# Needs root (debootstrap, chroot), debootstrap (installed with apt-get where missing), gcc, make, Go (first run) and the repo's venv
# (.venv/bin/pip, or VGPU_PIP) for `pip wheel`. VGPU_DEBIAN_MIRROR picks the Debian mirror.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
bin_dir=${VGPU_BIN_DIR:-$repo/.cache/bin}
image_dir=${VGPU_IMAGE_DIR:-$repo/.cache/images}
mirror=${VGPU_DEBIAN_MIRROR:-http://deb.debian.org/debian}
pip=${VGPU_PIP:-$repo/.venv/bin/pip}

SUITE=bookworm
BASE_PACKAGES=python3,python3-venv
BASE_STEP=1 # bump when build_base changes what it makes
SYSTEM_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# The tag of the project's images: "dev" (a build from this checkout, what the sandbox's real node
# and the tests import), or VGPU_IMAGE_TAG (make images IMAGE_TAG=...) for images to push to a
# registry and install with the chart (docs/install.md, "Images"). The names are the chart's.
tag=${VGPU_IMAGE_TAG:-dev}
[[ $tag =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] || {
  printf 'images: FAILED: VGPU_IMAGE_TAG=%s is not an image tag (letters, digits, _ . -)\n' "$tag" >&2
  exit 2
}
declare -A REF=(
  [device-plugin]=docker.io/vgpu/device-plugin:$tag
  [scheduler]=docker.io/vgpu/scheduler:$tag
  [sample]=docker.io/vgpu/sample:$tag
  [pause]=registry.k8s.io/pause:3.10
)
# kube-scheduler keeps upstream's name and the cluster's version as its tag, whatever
# VGPU_IMAGE_TAG says: the chart renders registry.k8s.io/kube-scheduler:<the API server's version>.
# shellcheck source=versions.env
. "$here/versions.env"
REF[kube-scheduler]=registry.k8s.io/kube-scheduler:$KUBE_VERSION
ALL=(device-plugin scheduler kube-scheduler sample pause)

log() { printf 'images: %s\n' "$*" >&2; }
die() {
  log "FAILED: $*"
  exit 1
}
need_root() {
  [ "$(id -u)" -eq 0 ] || die "needs root for debootstrap/chroot (the base root file system and the venv are made in a chroot); run it as root, e.g. sudo make images"
}
human() { numfmt --to=iec --suffix=B "$1" 2>/dev/null || printf '%sB' "$1"; }

# A short hash of the named files and folders under the repo (paths and contents), leaving out
# build output and bytecode.
tree_hash() {
  (cd "$repo" && find "$@" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' ! -path 'native/hook/build/*' -print0 |
    LC_ALL=C sort -z | xargs -0 sha256sum) | sha256sum | cut -c1-16
}
str_hash() { printf '%s' "$*" | sha256sum | cut -c1-16; }
# A tar of everything under $1 (paths relative to it, no ./ prefix), root-owned, in name order.
tar_dir() {
  local src=$1 out=$2
  shift 2
  (cd "$src" && find . -mindepth 1 -maxdepth 1 -printf '%P\n' | LC_ALL=C sort |
    tar --sort=name --numeric-owner --owner=0 --group=0 "$@" -cf "$out" -T -)
}

# ---- the Debian base: debootstrap, slimmed, cached; its gzip tar is every image's first layer ----
base_key=$(str_hash "$SUITE $BASE_PACKAGES $BASE_STEP $(uname -m)")
base_dir=$bin_dir/image-base-$base_key

build_base() {
  if [ -f "$base_dir/.complete" ]; then
    log "base: cached in $base_dir"
    return
  fi
  need_root
  local debootstrap
  debootstrap=$(command -v debootstrap || { [ -x /usr/sbin/debootstrap ] && echo /usr/sbin/debootstrap; } || true)
  if [ -z "$debootstrap" ] && command -v apt-get >/dev/null; then
    # A fresh Debian has no debootstrap: install it as node-setup.sh installs containerd.
    log "base: installing debootstrap (Debian package)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends debootstrap >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends debootstrap >/dev/null; } ||
      die "apt-get install debootstrap failed (output above)"
    debootstrap=$(command -v debootstrap || echo /usr/sbin/debootstrap)
  fi
  [ -n "$debootstrap" ] && [ -x "$debootstrap" ] || die "debootstrap is missing; install it with: apt-get install -y debootstrap"
  log "base: debootstrap --variant=minbase --include=$BASE_PACKAGES $SUITE from $mirror (first time only, a few minutes)"
  local start=$SECONDS tmp
  mkdir -p "$bin_dir"
  tmp=$(mktemp -d "$bin_dir/.image-base-XXXXXX")
  chmod 755 "$tmp"
  if ! "$debootstrap" --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$tmp/rootfs" "$mirror" >"$tmp/debootstrap.log" 2>&1; then
    tail -n 20 "$tmp/debootstrap.log" >&2
    rm -rf "$tmp"
    die "debootstrap of $SUITE failed (output above); check that $mirror is reachable or set VGPU_DEBIAN_MIRROR"
  fi
  local r=$tmp/rootfs
  # Slim it as Debian's slim images do: no package lists, apt caches, documentation (copyright
  # files stay), manuals or message translations (the C locale stays, it is in libc), and keep
  # later installs in the image from adding them back.
  rm -rf "${r:?}"/var/lib/apt/lists/* "${r:?}"/var/cache/apt/* "${r:?}"/var/cache/debconf/*-old "${r:?}"/var/log/* \
    "${r:?}"/usr/share/man/* "${r:?}"/usr/share/info/* "${r:?}"/usr/share/lintian "${r:?}"/usr/share/linda \
    "${r:?}"/dev/* "${r:?}"/run/* "${r:?}"/tmp/* "${r:?}"/var/tmp/*
  find "$r/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
  find "$r/usr/share/doc" -mindepth 1 -type d -empty -delete
  find "$r/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
  cat >"$r/etc/dpkg/dpkg.cfg.d/vgpu-slim" <<'EOF'
# tools/images.sh: keep the image small, as the base was made (copyright files stay).
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
  # Nothing of this machine in the image: the runtime provides these per container.
  : >"$r/etc/resolv.conf"
  printf 'localhost\n' >"$r/etc/hostname"
  rm -f "$r/etc/machine-id" "$r/var/lib/dbus/machine-id"
  tar_dir "$r" "$tmp/base.tar"
  gzip -n -6 "$tmp/base.tar"
  rm -f "$tmp/debootstrap.log"
  touch "$tmp/.complete"
  rm -rf "$base_dir"
  mv "$tmp" "$base_dir"
  log "base: built in $((SECONDS - start))s: $(human "$(du -sb "$base_dir/rootfs" | cut -f1)") unpacked, layer $(human "$(stat -c %s "$base_dir/base.tar.gz")")"
}

# A scratch copy of the base root file system to chroot into, with the device nodes that
# python and pip use (no mounts, so removing it can never reach the host's /dev or /proc).
scratch_root() {
  local root=$1
  need_root
  cp -a "$base_dir/rootfs" "$root"
  mknod -m 666 "$root/dev/null" c 1 3
  mknod -m 666 "$root/dev/zero" c 1 5
  mknod -m 666 "$root/dev/random" c 1 8
  mknod -m 666 "$root/dev/urandom" c 1 9
}
in_chroot() {
  local root=$1
  shift
  chroot "$root" /usr/bin/env -i PATH="$SYSTEM_PATH" HOME=/root LANG=C.UTF-8 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_CACHE_DIR=1 "$@"
}

# ---- ocipack, from Go modules (tools/build.sh's `ocipack` piece) ----
ocipack=
build_ocipack() {
  local out rc=0
  out=$(VGPU_BIN_DIR=$bin_dir bash "$here/build.sh" ocipack 2>&1) || rc=$?
  printf '%s\n' "$out" | sed 's/^setup: /images: /' >&2
  [ "$rc" -eq 0 ] || die "building ocipack from Go modules failed (output above); it needs Go >= 1.24 on PATH (GOTOOLCHAIN=local) and the Go module proxy (GOPROXY); see tools/build.sh and tools/ocipack/go.mod"
  ocipack=$(readlink -f "$bin_dir/current/ocipack")
  [ -x "$ocipack" ] || die "no ocipack in $bin_dir/current after tools/build.sh ocipack"
}

# ---- the multi-call kube binary (tools/build.sh's `kube` piece, cached by version) ----
kube_bin=
find_kube() {
  local out rc=0
  out=$(VGPU_BIN_DIR=$bin_dir bash "$here/build.sh" kube 2>&1) || rc=$?
  printf '%s\n' "$out" | sed 's/^setup: /images: /' >&2
  [ "$rc" -eq 0 ] || die "building kube $KUBE_VERSION from Go modules failed (output above); see tools/build.sh"
  kube_bin=$bin_dir/kube-$KUBE_VERSION/kube
  [ -x "$kube_bin" ] || die "no $kube_bin after tools/build.sh kube"
}

# ---- layers, cached in $image_dir/.layers by the hash of their inputs ----
layers_dir=$image_dir/.layers
work=

# layer KIND HASH FUNCTION: echoes the path of the layer tar, building it with FUNCTION OUT when
# missing.
# The key also carries this script and the base, so a change to how a layer is made remakes it.
layer() {
  local kind=$1 hash fn=$3 out
  hash=$(str_hash "$common_hash $base_key $2")
  out="$layers_dir/$kind-$hash.tar"
  if [ ! -f "$out" ]; then
    local start=$SECONDS
    # In a subshell with errexit on: under `||` bash would ignore every failure inside FUNCTION.
    local rc=0
    set +e
    (
      set -e
      "$fn" "$out.tmp"
    ) >&2
    rc=$?
    set -e
    [ "$rc" -eq 0 ] || die "$kind layer failed (output above)"
    mv "$out.tmp" "$out"
    find "$layers_dir" -name "$kind-*.tar" ! -name "$kind-$hash.tar" -delete
    log "layer $kind: built in $((SECONDS - start))s ($(human "$(stat -c %s "$out")"))"
  fi
  printf '%s' "$out"
}

check_pip() {
  [ -x "$pip" ] || die "no $pip to build wheels with; run \`make venv\` first (or set VGPU_PIP to a pip of Python 3.11)"
}
py_minor() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])'; }

# Wheels for the venv, built on this machine with the repo's pip: the dependencies once per
# pyproject.toml and requirements.lock (cached; the lock's pins), the vgpu wheel every time, from a
# clean copy of the sources.
wheels() {
  local out=$1
  check_pip
  local host_py image_py
  host_py=$(py_minor "$(dirname "$pip")/python")
  image_py=$(chroot "$base_dir/rootfs" /usr/bin/python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  [ "$host_py" = "$image_py" ] || die "the wheels are built with Python $host_py ($pip) but the image has Python $image_py; point VGPU_PIP at a pip of Python $image_py"
  local deps_dir
  deps_dir=$bin_dir/image-wheels-py$host_py-$(cat "$repo/pyproject.toml" "$repo/requirements.lock" | sha256sum | cut -c1-16)
  mkdir -p "$out"
  local src=$work/src
  mkdir -p "$src"
  cp "$repo/pyproject.toml" "$src/"
  tar -C "$repo" --exclude=__pycache__ --exclude='*.pyc' -cf - vgpu | tar -C "$src" -xf -
  if [ ! -f "$deps_dir/.complete" ]; then
    log "wheels: dependencies of pyproject.toml at requirements.lock's pins (first time for these two files)"
    local tmp
    mkdir -p "$bin_dir"
    tmp=$(mktemp -d "$bin_dir/.image-wheels-XXXXXX")
    "$pip" wheel -q --no-build-isolation -c "$repo/requirements.lock" --wheel-dir "$tmp" "$src" || {
      rm -rf "$tmp"
      die "pip wheel of the dependencies failed (output above); pip needs PyPI or a mirror (PIP_INDEX_URL)"
    }
    rm -f "$tmp"/vgpu-*.whl
    touch "$tmp/.complete"
    chmod 755 "$tmp"
    rm -rf "$deps_dir"
    mv "$tmp" "$deps_dir"
  fi
  cp "$deps_dir"/*.whl "$out/"
  "$pip" wheel -q --no-deps --no-build-isolation --wheel-dir "$out" "$src" || die "pip wheel of vgpu failed (output above)"
}

make_venv_layer() {
  local out=$1 root=$work/venv-root
  scratch_root "$root"
  wheels "$root/tmp/wheels"
  (
    umask 022
    in_chroot "$root" /usr/bin/python3 -m venv /opt/vgpu &&
      in_chroot "$root" /opt/vgpu/bin/pip install -q --no-index --no-compile --find-links /tmp/wheels vgpu &&
      in_chroot "$root" /opt/vgpu/bin/python -m compileall -q /opt/vgpu/lib &&
      in_chroot "$root" /opt/vgpu/bin/vgpu --help >/dev/null
  ) || return 1
  # Only what the venv step added: the /opt/vgpu tree.
  (cd "$root" && tar --sort=name --numeric-owner -cf "$out" opt/vgpu)
  rm -rf "$root"
}

# The hook says the image's tag as its version (native/hook/log.c), so images of two tags carry
# two libraries of different content, which the plugin installs on the host side by side. A tag
# other than dev builds apart, leaving the checkout's own build/libvgpu.so (dev) as it was.
make_hook_layer() {
  local out=$1 stage=$work/hook build=build
  [ "$tag" = dev ] || build=build/version-$tag
  make -s -C "$repo/native/hook" OUT="$build" HOOK_VERSION="$tag" "$build/libvgpu.so" >&2 || return 1
  install -D -m 0755 "$repo/native/hook/$build/libvgpu.so" "$stage/usr/local/vgpu/libvgpu.so"
  tar_dir "$stage" "$out"
}

multiarch() { gcc -print-multiarch 2>/dev/null | grep . || printf '%s-linux-gnu' "$(uname -m)"; }

# The stub driver libraries where a CUDA image has the injected driver, and the loader's cache
# with them (ldconfig in a chroot of the base), so programs linked with -lcuda find them.
make_stub_layer() {
  local out=$1 root=$work/stub-root stage=$work/stub ma
  ma=$(multiarch)
  make -s -C "$repo/native/hook" build/stub/libcuda.so.1 build/stub/libnvidia-ml.so.1 >&2 || return 1
  local lib
  for lib in libcuda libnvidia-ml; do
    install -D -m 0755 "$repo/native/hook/build/stub/$lib.so.1" "$stage/usr/lib/$ma/$lib.so.1"
    ln -s "$lib.so.1" "$stage/usr/lib/$ma/$lib.so"
  done
  scratch_root "$root"
  cp -a "$stage/usr/lib/$ma/." "$root/usr/lib/$ma/"
  chroot "$root" /sbin/ldconfig || return 1
  install -D -m 0644 "$root/etc/ld.so.cache" "$stage/etc/ld.so.cache"
  rm -rf "$root"
  tar_dir "$stage" "$out"
}

make_tests_layer() {
  local out=$1 stage=$work/tests t
  make -s -C "$repo/native/hook" build/tests/t_alloc build/tests/t_hold build/tests/t_info build/tests/t_bypass >&2 || return 1
  for t in t_alloc t_hold t_info t_bypass; do
    install -D -m 0755 "$repo/native/hook/build/tests/$t" "$stage/usr/local/bin/$t"
  done
  tar_dir "$stage" "$out"
}

make_pause_layer() {
  local out=$1 stage=$work/pause
  mkdir -p "$stage"
  gcc -static -O2 -Wall -Wextra -Werror -s -o "$stage/pause" "$here/images/pause.c" || {
    log "the static pause needs glibc's static library: apt-get install -y libc6-dev"
    return 1
  }
  tar_dir "$stage" "$out"
}

# kube-scheduler as upstream's image holds it: one static binary on PATH, nothing else (no shell,
# no libc). Here it is the multi-call kube binary, which runs as kube-scheduler when called by
# that name, so the chart's `command: [kube-scheduler]` finds the symlink.
make_kube_scheduler_layer() {
  local out=$1 stage=$work/kube-scheduler
  install -D -m 0755 "$kube_bin" "$stage/usr/local/bin/kube"
  ln -s kube "$stage/usr/local/bin/kube-scheduler"
  install -d -m 1777 "$stage/tmp"
  tar_dir "$stage" "$out"
}

# ---- images ----
py_env=(-env "PATH=/opt/vgpu/bin:$SYSTEM_PATH" -env PYTHONDONTWRITEBYTECODE=1 -env PYTHONUNBUFFERED=1)
common_hash=
kube_hash=
native_hash=
py_hash=

inputs_of() {
  case $1 in
    device-plugin) printf '%s' "$common_hash $base_key $py_hash $native_hash" ;;
    scheduler) printf '%s' "$common_hash $base_key $py_hash" ;;
    kube-scheduler) printf '%s' "$common_hash $kube_hash" ;;
    sample) printf '%s' "$common_hash $base_key $native_hash" ;;
    pause) printf '%s' "$common_hash $(tree_hash tools/images/pause.c)" ;;
  esac
}

# pack_args NAME: sets PACK to ocipack's arguments for the image, building missing layers.
pack_args() {
  local base=$base_dir/base.tar.gz venv hook stub tests pause
  case $1 in
    device-plugin)
      venv=$(layer venv "$py_hash" make_venv_layer)
      hook=$(layer hook "$native_hash $tag" make_hook_layer)
      PACK=(-layer "$base" -layer "$venv" -layer "$hook"
        -entrypoint '["vgpu"]' -cmd '["device-plugin","--help"]' -user 0:0
        "${py_env[@]}" -env VGPU_HOOK_LIBRARY=/usr/local/vgpu/libvgpu.so
        -label org.opencontainers.image.title=vgpu-device-plugin
        -label "org.opencontainers.image.description=vgpu device plugin, node monitor and hook library"
        -label org.opencontainers.image.licenses=Apache-2.0)
      ;;
    scheduler)
      venv=$(layer venv "$py_hash" make_venv_layer)
      PACK=(-layer "$base" -layer "$venv"
        -entrypoint '["vgpu"]' -cmd '["extender","--help"]' -user 65532:65532 "${py_env[@]}"
        -label org.opencontainers.image.title=vgpu-scheduler
        -label "org.opencontainers.image.description=vgpu scheduler extender and admission webhook"
        -label org.opencontainers.image.licenses=Apache-2.0)
      ;;
    kube-scheduler)
      PACK=(-layer "$(layer kube-scheduler "$kube_hash" make_kube_scheduler_layer)"
        -entrypoint '["/usr/local/bin/kube-scheduler"]' -user 65532:65532 -env "PATH=$SYSTEM_PATH"
        -label org.opencontainers.image.title=kube-scheduler
        -label "org.opencontainers.image.description=kube-scheduler $KUBE_VERSION (the multi-call kube binary of tools/kube)"
        -label org.opencontainers.image.licenses=Apache-2.0
        -label "org.opencontainers.image.version=$KUBE_VERSION")
      ;;
    sample)
      stub=$(layer stub "$native_hash" make_stub_layer)
      tests=$(layer tests "$native_hash" make_tests_layer)
      PACK=(-layer "$base" -layer "$stub" -layer "$tests"
        -cmd '["/bin/sh"]' -env "PATH=$SYSTEM_PATH"
        -label org.opencontainers.image.title=vgpu-sample
        -label "org.opencontainers.image.description=stand-in for a CUDA application image: the stub driver libraries and the hook's test programs"
        -label org.opencontainers.image.licenses=Apache-2.0)
      ;;
    pause)
      pause=$(layer pause "$(tree_hash tools/images/pause.c)" make_pause_layer)
      PACK=(-layer "$pause" -entrypoint '["/pause"]' -user 65535:65535
        -label org.opencontainers.image.title=pause
        -label "org.opencontainers.image.description=the pod sandbox process (tools/images/pause.c)"
        -label org.opencontainers.image.licenses=Apache-2.0)
      ;;
  esac
}

build_image() {
  local name=$1 tar="$image_dir/$1.tar" stamp="$image_dir/$1.tar.stamp" want
  want=$(str_hash "$(inputs_of "$name")")
  # another tag is another archive (it names the image); the default keeps the stamps it had
  [ "$tag" = dev ] || want=$(str_hash "$want ${REF[$name]}")
  if [ -f "$tar" ] && [ -f "$image_dir/$name.json" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    log "$name: current ($tar)"
    return
  fi
  local start=$SECONDS
  log "$name: building ${REF[$name]}"
  case $name in device-plugin | scheduler) check_pip ;; esac
  case $name in pause | kube-scheduler) ;; *) build_base ;; esac
  rm -f "$stamp"
  PACK=()
  pack_args "$name"
  "$ocipack" -ref "${REF[$name]}" -o "$tar" -info "$image_dir/$name.json" "${PACK[@]}" ||
    die "$name: ocipack failed (output above)"
  printf '%s\n' "$want" >"$stamp"
  log "$name: built in $((SECONDS - start))s: $tar ($(human "$(stat -c %s "$tar")"))"
}

write_index() {
  python3 - "$image_dir" "${ALL[@]}" <<'EOF'
import json, os, sys
image_dir, names = sys.argv[1], sys.argv[2:]
index = {}
for name in names:
    tar = os.path.join(image_dir, name + ".tar")
    info_path = os.path.join(image_dir, name + ".json")
    if not (os.path.exists(tar) and os.path.exists(info_path)):
        continue
    with open(info_path) as f:
        info = json.load(f)
    index[name] = {
        "ref": info["ref"],
        "file": os.path.abspath(tar),
        "tar_bytes": os.path.getsize(tar),
        "unpacked_bytes": info["unpacked_bytes"],
        "layers": info["layers"],
    }
tmp = os.path.join(image_dir, "images.json.tmp")
with open(tmp, "w") as f:
    json.dump(index, f, indent=2)
    f.write("\n")
os.replace(tmp, os.path.join(image_dir, "images.json"))
EOF
}

main() {
  local names=("$@") n
  [ ${#names[@]} -gt 0 ] || names=("${ALL[@]}")
  for n in "${names[@]}"; do
    [ -n "${REF[$n]:-}" ] || {
      log "unknown image '$n'; choose from ${ALL[*]}"
      exit 2
    }
  done
  # Every image but pause and kube-scheduler starts from the debootstrap base, finished in a chroot.
  if [ "$(id -u)" -ne 0 ]; then
    for n in "${names[@]}"; do case $n in pause | kube-scheduler) ;; *) need_root ;; esac; done
  fi
  local start=$SECONDS
  mkdir -p "$image_dir" "$layers_dir"
  exec 9>"$image_dir/.lock"
  flock 9 || die "could not lock $image_dir/.lock"
  build_ocipack
  common_hash=$(str_hash "$(sha256sum "$here/images.sh") $ocipack")
  native_hash=$(tree_hash native/hook)
  py_hash=$(tree_hash pyproject.toml requirements.lock vgpu)
  kube_hash=
  if [[ " ${names[*]} " == *" kube-scheduler "* ]]; then
    find_kube
    kube_hash=$(str_hash "$KUBE_VERSION $(sha256sum <"$kube_bin")")
  fi
  work=$(mktemp -d "${TMPDIR:-/tmp}/vgpu-images-XXXXXX")
  trap 'rm -rf "$work"' EXIT
  for n in "${names[@]}"; do build_image "$n"; done
  write_index
  log "done in $((SECONDS - start))s; $image_dir/images.json"
}

main "$@"
