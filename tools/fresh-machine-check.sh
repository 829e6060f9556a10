#!/usr/bin/env bash
# The README's two commands on a machine that has only what the README says it has: a clean
# Debian 12 root made with debootstrap, a clone of this repository in it, and from nothing
#
#   1. `make demo` as a plain user (uid 4242, no sudo)   -- set-up without root, the demo on KWOK nodes
#   2. `make demo` as root                                 -- adds the real node's set-up and the images
#   3. `make test` as root (under flock /tmp/vgpu-realnode.lock) -- every test that needs no GPU
#
# in the same clone, as a user would run them one after the other (each demo's sandbox is taken
# down after it with `.venv/bin/vgpu sandbox down`). Prints each command, its wall time and its
# result as a table at the end and exits non-zero if any failed. docs/fresh-machine.md says more.
#
#   sudo tools/fresh-machine-check.sh [--ref REF] [--dir DIR] [--phases LIST] [--no-lock] [--reuse DIR] [--keep]
#
#   --ref REF      the commit to clone (default: HEAD of the checkout holding this script)
#   --dir DIR      where the roots go (default: $VGPU_FRESH_DIR or /var/tmp/vgpu-fresh); each run
#                  makes DIR/<UTC stamp>/root; never inside the clone
#   --phases LIST  comma-separated, in order: user-demo, root-demo, root-test (default: all three);
#                  `--phases none` stops after preparing the root (a cheap trial of debootstrap,
#                  the packages and the clone)
#   --no-lock      run `make test` without `flock /tmp/vgpu-realnode.lock` (VGPU_FRESH_LOCK=0). The
#                  lock is on by default: the real node the tests start shares this machine's
#                  network namespace (bridge vgpu-sbx0, 10.244.200.1) and cgroups with every other
#                  real node on it.
#   --reuse DIR    no new root: run the phases again in DIR/root of an earlier run (kept), its clone
#                  moved to --ref with its build outputs left as they are (to show a fix without
#                  starting from nothing again; the table says so)
#   --keep         keep the root after a run that passed (a failed run's root is always kept, for
#                  looking at; remove it with `rm -rf --one-file-system DIR/<stamp>`)
#
# What the root gets, and nothing else from this machine:
#   - Debian 12 `--variant=minbase` (required packages and apt) from $VGPU_DEBIAN_MIRROR
#     (default http://deb.debian.org/debian), then the README's prerequisites from Debian:
#     python3.11 python3.11-venv gcc libc6-dev make git (FRESH_PACKAGES).
#   - Every command runs in the root as in a machine of its own: a mount namespace whose root is
#     the root (pivot_root, not chroot: runc exec needs it) and a PID namespace; it shares this
#     machine's network and cgroups.
#   - Go: Debian 12's Go (1.19) is older than tools/*/go.mod ask for, and the README names Go as
#     given, so this machine's toolchain (`go env GOROOT`) is copied to /usr/local/go in the root.
#   - How this machine reaches the registries, never what it fetched from them: apt's sources,
#     keyrings and Acquire:: settings, /etc/pip.conf and the PIP_* settings that name an index, a
#     certificate or a timeout (PIP_FIND_LINKS, a local wheel folder, stays out), the Go proxy and
#     checksum settings (`go env`), *_proxy variables, the CA bundle and /etc/resolv.conf.
#     No ~/.cache/vgpu, Go module or build cache, pip cache or apt archives.
set -uo pipefail
# One block to the end: bash reads all of it before running any, so a run of an hour is safe from
# edits to this file (a checkout moving on under it).
{
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")

SUITE=bookworm
FRESH_PACKAGES=${FRESH_PACKAGES:-python3.11 python3.11-venv gcc libc6-dev make git}
PLAIN_USER=vgpu
PLAIN_UID=4242
mirror=${VGPU_DEBIAN_MIRROR:-http://deb.debian.org/debian}
base=${VGPU_FRESH_DIR:-/var/tmp/vgpu-fresh}
ref=HEAD
phases=user-demo,root-demo,root-test
lock=${VGPU_FRESH_LOCK:-1}
keep=0
reuse=

log() { printf 'fresh: %s %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() {
  log "FAILED: $*"
  exit 1
}

while [ $# -gt 0 ]; do
  case $1 in
    --ref) ref=${2:?--ref needs a value}; shift 2 ;;
    --dir) base=${2:?--dir needs a value}; shift 2 ;;
    --phases) phases=${2:?--phases needs a value}; shift 2 ;;
    --no-lock) lock=0; shift ;;
    --keep) keep=1; shift ;;
    --reuse) reuse=${2:?--reuse needs a value}; shift 2 ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
IFS=, read -r -a wanted <<<"$phases"
for p in "${wanted[@]}"; do
  case $p in user-demo | root-demo | root-test | none) ;; *) die "--phases: no phase '$p'; choose from user-demo, root-demo, root-test, none" ;; esac
done

[ "$(id -u)" -eq 0 ] || die "needs root (debootstrap, chroot and mounts); run it with sudo"
for tool in git chroot mount umount flock; do
  command -v "$tool" >/dev/null || die "$tool is missing on this machine"
done
# The Go toolchain to copy: VGPU_FRESH_GOROOT, else `go env GOROOT` of the go on PATH, else
# /usr/local/go (sudo's PATH often lacks it).
goroot=${VGPU_FRESH_GOROOT:-$(go env GOROOT 2>/dev/null || true)}
[ -n "$goroot" ] || goroot=/usr/local/go
go=$goroot/bin/go
[ -x "$go" ] || die "no Go toolchain at $goroot; set VGPU_FRESH_GOROOT to one (Go 1.26.8 or newer)"
sha=$(git -C "$repo" rev-parse --verify "$ref^{commit}") || die "--ref $ref is not a commit of $repo"
abs_base=$(realpath -m "$base")
case $abs_base/ in "$(realpath "$repo")"/*) die "--dir $base is inside the clone $repo; pick a folder outside it" ;; esac

debootstrap=$(command -v debootstrap || { [ -x /usr/sbin/debootstrap ] && echo /usr/sbin/debootstrap; } || true)
if [ -z "$debootstrap" ]; then
  command -v apt-get >/dev/null || die "debootstrap is missing; install it with your package manager"
  log "installing debootstrap (Debian package)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null; } ||
    die "apt-get install debootstrap failed"
  debootstrap=$(command -v debootstrap || echo /usr/sbin/debootstrap)
fi

if [ -n "$reuse" ]; then
  top=$(realpath "$reuse") && [ -d "$top/root/home/$PLAIN_USER/vgpu/.git" ] || die "--reuse $reuse: no earlier run's root with a clone there"
  keep=1
else
  top=$abs_base/$(date -u +%Y%m%dT%H%M%SZ)
  mkdir -p "$top" || die "cannot make $top"
fi
root=$top/root

# ---- clean-up on any exit: processes whose root is ours (we started them), then the mounts ----
mounts_under() {
  # mount points at or below $root, deepest first
  awk -v r="$root" '{ p = $5; gsub(/\\040/, " ", p); if (p == r || index(p, r "/") == 1) print p }' /proc/self/mountinfo |
    awk '{ print gsub("/", "/"), $0 }' | sort -rn | cut -d' ' -f2-
}
stop_our_processes() {
  local pid pids=() link
  for link in /proc/[0-9]*/root; do
    pid=${link#/proc/}
    pid=${pid%/root}
    [ "$(readlink "$link" 2>/dev/null)" = "$root" ] && pids+=("$pid")
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  log "stopping ${#pids[@]} processes left in the root: ${pids[*]}"
  kill -TERM "${pids[@]}" 2>/dev/null
  sleep 5
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null; done
  return 0
}
unmount_all() {
  local m
  for _ in 1 2 3; do
    mounts_under | while IFS= read -r m; do umount -l "$m" 2>/dev/null || umount -f "$m" 2>/dev/null; done
    [ -z "$(mounts_under)" ] && return 0
    sleep 1
  done
  [ -z "$(mounts_under)" ]
}
failed=0
tabled=0
declare -a rows=()
cleanup() {
  local rc=$?
  [ -d "$root" ] || exit "$rc"
  # stopped half-way (a signal, an error): what ran so far
  [ "$tabled" = 1 ] || [ ${#rows[@]} -eq 0 ] || table
  stop_our_processes
  if ! unmount_all; then
    log "could not unmount everything under $root; left as it is:"
    mounts_under >&2
    exit 1
  fi
  if [ "$rc" -eq 0 ] && [ "$failed" -eq 0 ] && [ "$keep" -eq 0 ]; then
    log "removing $top"
    rm -rf --one-file-system "$top"
  else
    log "the root stays in $root (remove it with: rm -rf --one-file-system $top)"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- the phases: a table of what ran ----
run_phase() { # NAME USER COMMAND...
  local name=$1 who=$2 start rc
  shift 2
  log "== $name: $* (as $who)"
  start=$(date +%s)
  "$@"
  rc=$?
  local secs=$(($(date +%s) - start))
  rows+=("$name|$who|$(printf '%s' "${shown_cmd:-$*}")|$secs|$rc")
  shown_cmd=
  [ "$rc" -eq 0 ] || failed=1
  log "== $name: exit $rc after $(fmt "$secs")"
  return "$rc"
}
fmt() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }
table() {
  local total=0 r name who cmd secs rc
  tabled=1
  printf '\nfresh-machine check of %s (%s), root %s\n' "$sha" "$ref" "$root"
  printf '%-12s %-6s %-58s %9s  %s\n' phase user command time result
  for r in "${rows[@]}"; do
    IFS='|' read -r name who cmd secs rc <<<"$r"
    total=$((total + secs))
    printf '%-12s %-6s %-58s %9s  %s\n' "$name" "$who" "$cmd" "$(fmt "$secs")" "$([ "$rc" -eq 0 ] && echo ok || echo "FAILED (exit $rc)")"
  done
  printf '%-12s %-6s %-58s %9s\n' total '' '' "$(fmt "$total")"
}

# ---- the root ----
prepare_root() {
  log "debootstrap --variant=minbase $SUITE into $root from $mirror"
  "$debootstrap" --variant=minbase "$SUITE" "$root" "$mirror" >"$top/debootstrap.log" 2>&1 ||
    { tail -n 20 "$top/debootstrap.log" >&2; return 1; }
  copy_registry_config || return 1
  mount_all || return 1
  log "apt-get install $FRESH_PACKAGES"
  in_root root env DEBIAN_FRONTEND=noninteractive sh -c "apt-get update -q && apt-get install -y -q $FRESH_PACKAGES" \
    >"$top/apt.log" 2>&1 || { tail -n 20 "$top/apt.log" >&2; return 1; }
  log "Go: $goroot ($("$go" env GOVERSION)) to /usr/local/go"
  mkdir -p "$root/usr/local/go" && cp -a "$goroot/." "$root/usr/local/go/" || return 1
  chroot "$root" useradd -m -u "$PLAIN_UID" -s /bin/bash "$PLAIN_USER" || return 1
  log "git clone $repo at $sha into /home/$PLAIN_USER/vgpu"
  local clone=$root/home/$PLAIN_USER/vgpu
  git clone -q --no-checkout "$repo" "$clone" &&
    git -C "$clone" fetch -q "$repo" "$sha" &&
    git -C "$clone" checkout -q -B main "$sha" &&
    git -C "$clone" remote remove origin &&
    chown -R "$PLAIN_UID:$PLAIN_UID" "$clone" || return 1
  log "root ready: $(du -sh --one-file-system "$root" | cut -f1)"
}

copy_registry_config() {
  local f
  rm -f "$root/etc/apt/sources.list"
  [ -f /etc/apt/sources.list ] && cp /etc/apt/sources.list "$root/etc/apt/"
  for f in /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources /etc/apt/auth.conf.d/* \
    /etc/apt/trusted.gpg.d/* /etc/apt/keyrings/* /etc/apt/trusted.gpg; do
    [ -f "$f" ] && install -D -m "$(stat -c %a "$f")" "$f" "$root$f"
  done
  for f in /etc/apt/apt.conf.d/*; do # how apt reaches the archive: proxies, checks, retries
    [ -f "$f" ] && grep -v IndexTargets "$f" | grep -q '^[[:space:]]*Acquire' && cp "$f" "$root/etc/apt/apt.conf.d/"
  done
  # a sources file naming a keyring that neither this machine nor the root has would stop apt
  local key
  for f in "$root"/etc/apt/sources.list.d/*; do
    [ -f "$f" ] || continue
    for key in $(grep -hoE '(Signed-By:|signed-by=)[[:space:]]*[^] ]+' "$f" | sed -E 's/^(Signed-By:|signed-by=)[[:space:]]*//'); do
      [ -e "$root$key" ] && continue
      if [ -f "$key" ]; then
        install -D -m 0644 "$key" "$root$key"
      else
        log "leaving out $f: its keyring $key is on neither this machine nor the root"
        rm -f "$f"
      fi
    done
  done
  cp -L /etc/resolv.conf "$root/etc/resolv.conf"
  [ -f /etc/pip.conf ] && cp /etc/pip.conf "$root/etc/pip.conf"
  # CA certificates: this machine's bundle and its local additions (a TLS-inspecting proxy's CA
  # would be there); Debian's ca-certificates package, if set-up installs it, rebuilds from both.
  if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    install -D -m 0644 /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  fi
  if [ -d /usr/local/share/ca-certificates ]; then
    mkdir -p "$root/usr/local/share/ca-certificates" && cp -a /usr/local/share/ca-certificates/. "$root/usr/local/share/ca-certificates/"
  fi
  # The environment both users get: the Go proxy and checksum settings as `go env` reports them
  # here, pip's index, certificate and timeout settings, proxies and CA variables.
  {
    local v
    for v in GOPROXY GOSUMDB GONOSUMDB GOPRIVATE GONOPROXY GOINSECURE GOFLAGS; do
      printf '%s=%s\n' "$v" "$("$go" env "$v")"
    done
    env | grep -E '^(PIP_(INDEX_URL|EXTRA_INDEX_URL|TRUSTED_HOST|CERT|CLIENT_CERT|DEFAULT_TIMEOUT|DISABLE_PIP_VERSION_CHECK|RETRIES)|(http|https|ftp|no|all)_proxy|(HTTP|HTTPS|FTP|NO|ALL)_PROXY|SSL_CERT_FILE|SSL_CERT_DIR|REQUESTS_CA_BUNDLE|CURL_CA_BUNDLE|GIT_SSL_CAINFO)='
  } >"$top/registry.env"
  log "registry settings for both users: $(cut -d= -f1 "$top/registry.env" | tr '\n' ' ')"
}

mount_all() {
  # The root a mount point of its own: runc's pivot_root refuses a root that is not one (the
  # state a plain chroot leaves), and private, as this machine's / is here.
  mount --bind "$root" "$root" && mount --make-private "$root" &&
    mount -t proc proc "$root/proc" &&
    mount --rbind /sys "$root/sys" && mount --make-rslave "$root/sys" &&
    mount --rbind /dev "$root/dev" && mount --make-rslave "$root/dev" &&
    mkdir -p "$root/run/shm" && mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$root/run" &&
    mkdir -p "$root/lib/modules" && { [ ! -d /lib/modules ] || mount --bind -o ro /lib/modules "$root/lib/modules"; }
}

# in_root USER COMMAND...: a login-like environment for USER in the root, and nothing from ours
in_root() {
  local who=$1 home path
  shift
  if [ "$who" = root ]; then
    home=/root path=/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
  else
    home=/home/$who path=/usr/local/go/bin:/usr/local/bin:/usr/bin:/bin
  fi
  local envs=()
  [ -f "$top/registry.env" ] && mapfile -t envs <"$top/registry.env"
  # Not a plain chroot: there the root of the mount namespace stays this machine's /, and a process
  # that joins a container's mount namespace (runc exec: kubectl exec) lands in it, not in the
  # container's file system. So a mount namespace whose root is the root (pivot_root), as a
  # machine's own, and a PID namespace with a /proc of its own, whose end ends every process the
  # command left behind (a sandbox, containerd's shims).
  unshare --mount --pid --fork --kill-child --propagation private -- /bin/sh -c '
    set -e
    cd "$1"
    shift
    mkdir -p .fresh-oldroot
    pivot_root . .fresh-oldroot
    umount -l /.fresh-oldroot
    rmdir /.fresh-oldroot
    mount -t proc -o nosuid,nodev,noexec proc /proc
    exec "$@"' fresh-root "$root" \
    chroot --userspec="$who:$who" / /usr/bin/env -i HOME="$home" USER="$who" LOGNAME="$who" \
    PATH="$path" LANG=C.UTF-8 TERM=dumb SHELL=/bin/bash "${envs[@]}" "$@"
}
in_clone() { # USER SHELL-COMMAND
  local who=$1
  in_root "$who" bash -c "cd /home/$PLAIN_USER/vgpu && $2"
}

phase_demo() { # USER: make demo, then the sandbox it leaves up taken down (in the same namespaces)
  in_clone "$1" 'echo "+ $(id -un): make demo"; make demo; rc=$?
    [ ! -x .venv/bin/vgpu ] || .venv/bin/vgpu sandbox down || echo "fresh: vgpu sandbox down failed" >&2
    exit $rc'
}
# --reuse: the clone at the commit asked for, its build outputs (.venv, .cache) kept
update_clone() {
  mount_all || return 1
  local clone=$root/home/$PLAIN_USER/vgpu
  git -c safe.directory="$clone" -C "$clone" fetch -q "$repo" "$sha" &&
    chown -R "$PLAIN_UID:$PLAIN_UID" "$clone/.git" &&
    in_clone "$PLAIN_USER" "git stash -q --include-untracked 2>/dev/null; git checkout -q -B main $sha && git log --oneline -1"
}

t0=$(date +%s)
log "fresh-machine check of $sha ($ref) in $root"
if [ -n "$reuse" ]; then
  shown_cmd="(reused root) git checkout $(git -C "$repo" rev-parse --short "$sha")" run_phase prepare root update_clone
else
  shown_cmd="debootstrap $SUITE; apt-get install ...; Go; git clone" run_phase prepare root prepare_root
fi || {
  table
  exit 1
}
for p in "${wanted[@]}"; do
  case $p in
    none) ;;
    user-demo) shown_cmd="make demo; .venv/bin/vgpu sandbox down" run_phase user-demo "$PLAIN_USER" phase_demo "$PLAIN_USER" ;;
    root-demo) shown_cmd="make demo; .venv/bin/vgpu sandbox down" run_phase root-demo root phase_demo root ;;
    root-test)
      if [ "$lock" = 1 ]; then
        exec 8>/tmp/vgpu-realnode.lock
        log "waiting for /tmp/vgpu-realnode.lock (the real node shares this machine's network and cgroups)"
        waited=$(date +%s)
        flock 8
        waited=$(($(date +%s) - waited))
        rows+=("lock-wait|root|flock /tmp/vgpu-realnode.lock (waiting for other real nodes)|$waited|0")
        log "got /tmp/vgpu-realnode.lock after $(fmt "$waited")"
        shown_cmd="flock /tmp/vgpu-realnode.lock make test" run_phase root-test root in_clone root 'make test' 8>&-
        flock -u 8
        exec 8>&-
      else
        shown_cmd="make test" run_phase root-test root in_clone root 'make test'
      fi
      ;;
  esac
done
table
log "all phases: $(fmt $(($(date +%s) - t0)))"
exit "$failed"
}
