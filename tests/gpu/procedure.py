"""The GPU proofs: every module of tests/gpu, in as few device calls as fit one call's 10 minutes
and 64 MiB (tests/README.md, "Running the GPU proofs"). Each part names the bundle part it needs
staged (tools/gpu-bundle.sh stage a|b) and its modules; tests/unit/test_gpu_procedure.py checks
that every GPU module is in exactly one part, so a new module cannot be left out.

    python3 tests/gpu/procedure.py PART [pytest arguments]   # on the GPU machine, as root
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# part -> (the bundle part it needs staged, its modules); about 9, 8 and 9 minutes on an H200 (a-c)
PARTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "a": ("a", ("test_compute_share_gpu.py", "test_compute_gate_gpu.py")),
    "b": ("b", ("test_dra_gpu.py", "test_pod_on_gpu.py", "test_hook_gpu.py", "test_container_on_gpu.py")),
    "c": (
        "a",
        (
            "test_many_gpu.py",
            "test_limits_gpu.py",
            "test_spill_gpu.py",
            "test_enforce_gpu.py",
            "test_grant_gpu.py",
            "test_plugin_nvml.py",
            "test_mig_tables_gpu.py",
            "test_plugin_on_gpu.py",
        ),
    ),
    # issue 39: MPS mode (the hook, PyTorch and a real MPS control daemon, no real node) and two
    # tenants capped 50/50 under time-slicing with the node; bundle part a for the node's parts
    # (the product's wheels); about 4 minutes
    "d": ("a", ("test_mps_gpu.py", "test_compute_pair_gpu.py")),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in PARTS:
        print(f"usage: procedure.py {'|'.join(PARTS)} [pytest arguments]", file=sys.stderr)
        return 2
    _, modules = PARTS[argv[0]]
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-rs", "-s"]
    return subprocess.call([*command, *(str(HERE / m) for m in modules), *argv[1:]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
