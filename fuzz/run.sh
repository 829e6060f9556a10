#!/usr/bin/env bash
# Build and run every fuzz harness (or those named) for a bounded time each; fail on any crash.
#   bash fuzz/run.sh [NAME...]       (what `make fuzz` runs)
# FUZZ_SECONDS: seconds per harness (default 20). FUZZ_OUT: working folder (default .cache/fuzz):
# the corpus each run grows (corpus/NAME), its log (logs/NAME.log), what crashed (artifacts/NAME/).
# Seeds come from fuzz/corpus/NAME and fuzz/regressions/NAME (every input that crashed once).
set -uo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${FUZZ_SECONDS:-20}
OUT=$(mkdir -p "${FUZZ_OUT:-.cache/fuzz}" && cd "${FUZZ_OUT:-.cache/fuzz}" && pwd) || exit 1
PY=${FUZZ_PYTHON:-.venv/bin/python}

# name:engine:dictionary (engine: py = atheris over fuzz/properties.py, or a binary of fuzz/native)
HARNESSES=(
  devices_annotation:py:json
  allocation_annotation:py:json
  pod_request:py:json
  extender_body:py:json
  worker_head:py:http
  region_file:py:
  config_env:fuzz_config:
  region_hook:fuzz_region:
  grant_file:py:
  resource_claim:py:json
  lease_view:py:json
  grant_hook:fuzz_grant:
)

missing=()
if ! "$PY" -c 'import atheris' 2>/dev/null; then
  missing+=("atheris in $PY (make venv installs it with the dev extra; or: $PY -m pip install atheris)")
fi
if ! command -v clang >/dev/null; then
  missing+=("clang (make fuzz-tools, as root: apt-get install clang libclang-rt-dev)")
elif ! printf 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { (void)d; (void)n; return 0; }\n' |
  clang -x c -fsanitize=fuzzer,address,undefined -o /dev/null - 2>/dev/null; then
  missing+=("clang's libFuzzer and sanitizer runtimes (make fuzz-tools, as root: apt-get install libclang-rt-dev)")
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "fuzz: cannot run, missing:" >&2
  printf '  - %s\n' "${missing[@]}" >&2
  exit 2
fi

wanted=("$@")
for name in "${wanted[@]}"; do
  [[ " ${HARNESSES[*]} " == *" $name:"* ]] || { echo "fuzz: no harness named $name (fuzz/run.sh HARNESSES)" >&2; exit 2; }
done

make -s -C fuzz/native OUT="$OUT/bin" || { echo "fuzz: building the native harnesses failed" >&2; exit 1; }
failed=()
summary=()
for entry in "${HARNESSES[@]}"; do
  IFS=: read -r name engine dict <<<"$entry"
  if [ ${#wanted[@]} -gt 0 ] && [[ " ${wanted[*]} " != *" $name "* ]]; then continue; fi
  mkdir -p "$OUT/corpus/$name" "$OUT/artifacts/$name" "$OUT/logs" "fuzz/regressions/$name"
  flags=(-max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
         -artifact_prefix="$OUT/artifacts/$name/")
  [ -n "$dict" ] && flags+=(-dict="fuzz/dicts/$dict.dict")
  dirs=("$OUT/corpus/$name" "fuzz/corpus/$name" "fuzz/regressions/$name")
  if [ "$engine" = py ]; then
    cmd=("$PY" fuzz/run_atheris.py "$name" "${flags[@]}" "${dirs[@]}")
  else
    cmd=("$OUT/bin/$engine" -close_fd_mask=2 "${flags[@]}" "${dirs[@]}")  # the hook's own log off
  fi
  log="$OUT/logs/$name.log"
  echo "fuzz: $name for ${SECONDS_EACH}s"
  rm -rf "$OUT/tmp" && mkdir -p "$OUT/tmp"
  TMPDIR="$OUT/tmp" "${cmd[@]}" >"$log" 2>&1  # the region harnesses' files, removed after each run
  rc=$?
  rm -rf "$OUT/tmp"
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  cov=$(grep -oE '^#[0-9]+.*cov: [0-9]+ ft: [0-9]+' "$log" | tail -1 | grep -oE 'cov: [0-9]+ ft: [0-9]+')
  line=$(printf '%-22s %12s execs  %-20s' "$name" "${execs:-?}" "${cov:-}")
  if [ "$rc" -ne 0 ]; then
    failed+=("$name")
    summary+=("$line  CRASH (exit $rc)")
    echo "fuzz: $name failed (exit $rc); the end of $log:" >&2
    grep -vE '^#[0-9]+ +(NEW|REDUCE|pulse|RELOAD)' "$log" | tail -40 >&2
    echo "fuzz: the input is in $OUT/artifacts/$name/; copy it to fuzz/regressions/$name/ (docs/fuzzing.md)" >&2
  else
    summary+=("$line  ok")
  fi
done

echo "fuzz: harness                executions  coverage (edges, features)"
printf '  %s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz: no crash in ${#summary[@]} harnesses"
