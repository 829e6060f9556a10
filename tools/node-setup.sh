#!/usr/bin/env bash
# What the sandbox's real node needs (vgpu sandbox up --real-node; tests/e2e/test_real_node.py):
# runc, the CNI plugins and iproute2 from Debian's packages, and containerd 2 (with its shim and
# ctr), the kubelet, crictl and nvidia-ctk built from Go modules (tools/build.sh). Debian's
# containerd (1.6) has no CDI, so the node's containerd is built too. The images come from
# `make images`.
#
# A real node needs root. Elsewhere this says so and exits 0: the real-node tests then skip,
# naming the reason. It never replaces a container runtime the machine already has: a package
# is installed only when its program is missing, and the containerd built here lives in the
# binaries' cache, never on PATH (a machine's own containerd, Debian's or Docker's, stays as it is).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if [ "$(id -u)" -ne 0 ]; then
  echo "node-setup: not root, so no real node here (vgpu sandbox up --real-node needs root); skipped"
  exit 0
fi

missing=()
command -v runc >/dev/null || [ -x /usr/sbin/runc ] || missing+=(runc)
[ -x /usr/lib/cni/bridge ] || [ -x /opt/cni/bin/bridge ] || missing+=(containernetworking-plugins)
# The sandbox makes the pods' bridge with ip(8); a minimal Debian (debootstrap, container images)
# has neither iproute2 nor, at times, util-linux's unshare and setpriv, which the tests use.
command -v ip >/dev/null || [ -x /usr/sbin/ip ] || [ -x /sbin/ip ] || missing+=(iproute2)
command -v unshare >/dev/null && command -v setpriv >/dev/null || missing+=(util-linux)
if [ ${#missing[@]} -gt 0 ]; then
  if ! command -v apt-get >/dev/null; then
    echo "node-setup: ${missing[*]} missing and there is no apt-get; install them with your package manager" >&2
    exit 1
  fi
  echo "node-setup: installing ${missing[*]} (Debian packages)"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
    apt-get update -q >/dev/null &&
      apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null || {
      echo "node-setup: apt-get install ${missing[*]} failed" >&2
      exit 1
    }
  fi
fi
bash "$here/build.sh" kubelet containerd crictl nvidia-ctk
