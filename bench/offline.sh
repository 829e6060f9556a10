#!/usr/bin/env bash
# Run bench/bench_scheduler.py on another x86-64 Linux machine that has Python 3 but neither the
# Go toolchain nor a package index: typically a bigger box than this project's 2-core VM, so the
# control plane and KWOK's nodes do not share two cores with the schedulers being measured.
#
#   here:   bench/offline.sh pack DIR [PYTHON_VERSION]   (default 3.12)
#           packs the control-plane binaries `make setup` built (xz) and the wheels the
#           extender and the bench need for that Python into DIR;
#   there:  bench/offline.sh run DIR [bench_scheduler.py arguments...]
#           from a checkout of this repository, with DIR copied over.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cmd=${1:-}
dir=${2:-}
if [[ -z "$cmd" || -z "$dir" ]]; then
  sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
shift 2

case "$cmd" in
pack)
  pyver=${1:-3.12}
  bins=${VGPU_BIN_DIR:-$repo/.cache/bin}/current
  for b in kube kwok etcd; do
    [[ -x "$bins/$b" ]] || { echo "missing $bins/$b: run \`make setup\` first" >&2; exit 1; }
  done
  mkdir -p "$dir/bin" "$dir/wheels"
  for b in kube kwok etcd; do
    xz -T0 -6 -c "$(readlink -f "$bins/$b")" >"$dir/bin/$b.xz"
  done
  # the runtime dependencies in pyproject.toml, and requests for the bench itself
  reqs=$("$repo/.venv/bin/python" - "$repo/pyproject.toml" <<'EOF'
import sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
print("\n".join([d.split("#")[0].strip() for d in deps] + ["requests"]))
EOF
)
  platforms=()
  for p in manylinux_2_34 manylinux_2_28 manylinux_2_17 manylinux2014; do
    platforms+=(--platform "${p}_x86_64")
  done
  # shellcheck disable=SC2086
  "$repo/.venv/bin/python" -m pip download -q --only-binary=:all: --implementation cp \
    --python-version "$pyver" "${platforms[@]}" -d "$dir/wheels" $reqs
  du -sh "$dir"
  ;;
run)
  site=$dir/site
  bin=$dir/cp/current
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$dir"/wheels/*.whl
  mkdir -p "$bin"
  for b in kube kwok etcd; do
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"), 1 << 20)' \
      "$dir/bin/$b.xz" "$bin/$b" &
  done
  wait
  chmod 755 "$bin"/kube "$bin"/kwok "$bin"/etcd
  for n in kube-apiserver kube-controller-manager kube-scheduler kubectl; do ln -sf kube "$bin/$n"; done
  cd "$repo"
  VGPU_BIN_DIR=$dir/cp PYTHONPATH=$site:$repo PYTHONUNBUFFERED=1 python3 bench/bench_scheduler.py "$@"
  ;;
*)
  echo "unknown command $cmd: pack or run" >&2
  exit 2
  ;;
esac
