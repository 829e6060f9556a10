#!/usr/bin/env bash
# What the native fuzz harnesses need: clang with its libFuzzer and sanitizer runtimes.
# Installs them from Debian's packages when missing (as root, as CI runs); else says what to do and
# skips (exit 0): only `make fuzz` needs them, and fuzz/run.sh stops there naming what is missing.
set -uo pipefail

works() {
  command -v clang >/dev/null &&
    printf 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { (void)d; (void)n; return 0; }\n' |
    clang -x c -fsanitize=fuzzer,address,undefined -o /dev/null - 2>/dev/null
}

works && exit 0
# clang is Debian's default version; libclang-rt-dev holds that version's libFuzzer and ASan/UBSan
packages=(clang libclang-rt-dev)
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  # Only `make fuzz` needs them (it stops there, naming them): the rest of set-up goes on.
  echo "fuzz-tools: clang with libFuzzer is missing, so \`make fuzz\` cannot run here (the rest needs neither);" \
    "skipped: as root on Debian: apt-get install ${packages[*]} (or run \`make fuzz-tools\` as root)" >&2
  exit 0
fi
echo "fuzz-tools: installing ${packages[*]} (Debian packages)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null &&
  apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null || {
  echo "fuzz-tools: apt-get install ${packages[*]} failed" >&2
  exit 1
}
works || { echo "fuzz-tools: clang is installed but cannot link -fsanitize=fuzzer" >&2; exit 1; }
