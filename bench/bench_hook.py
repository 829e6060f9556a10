"""libvgpu's cost on the two hot paths: an empty-kernel launch and a 1 MiB cuMemAlloc+cuMemFree.

Runs native/hook's b_hook (driver API, linked like any CUDA program) four ways: without the
hook, preloaded with no limit, preloaded with a 4 GiB limit (private region), and with a 4 GiB
limit and a region file (in a temporary folder and, where it exists, in /dev/shm).
Configurations are interleaved over several rounds, in a rotating order, and the median per
call is printed with the overhead against the run without the hook. Targets (issue 5): launch
<= 1%, alloc/free <= 10%.

On a machine without a GPU it runs over the stub driver and says so: those figures are the
hook's own bookkeeping against a driver that does nothing, an upper bound on its relative cost.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "native" / "hook"
BUILD = HOOK / "build"


def has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    return smi is not None and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


def run_once(env: dict[str, str], launches: int, allocs: int, repeats: int) -> dict[str, float]:
    out = subprocess.run(
        [str(BUILD / "b_hook"), str(launches), str(allocs), str(repeats)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    ).stdout
    values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    if "error" in values:
        raise SystemExit(f"b_hook failed: {values['error']}")
    return {key: float(value) for key, value in values.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--launches", type=int, default=100000)
    parser.add_argument("--allocs", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3, help="timed loops per process")
    args = parser.parse_args()
    subprocess.run(["make", "-s", "-C", str(HOOK)], check=True)
    gpu = has_gpu()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_DEVICE_", "LD_PRELOAD"))}
    if not gpu:
        base["LD_LIBRARY_PATH"] = str(BUILD / "stub")
    with tempfile.TemporaryDirectory() as tmp:
        configs = {
            "no hook": base,
            "hook, no limit": base | {"LD_PRELOAD": str(BUILD / "libvgpu.so")},
            "hook, 4 GiB, private": base
            | {"LD_PRELOAD": str(BUILD / "libvgpu.so"), "CUDA_DEVICE_MEMORY_LIMIT": "4g"},
            "hook, 4 GiB, region": base
            | {
                "LD_PRELOAD": str(BUILD / "libvgpu.so"),
                "CUDA_DEVICE_MEMORY_LIMIT": "4g",
                "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(Path(tmp) / "region"),
            },
        }
        if Path("/dev/shm").is_dir():
            configs["hook, 4 GiB, shm region"] = configs["hook, 4 GiB, region"] | {
                "CUDA_DEVICE_MEMORY_SHARED_CACHE": f"/dev/shm/vgpu-bench-{os.getpid()}"
            }
        names = list(configs)
        results: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
        for r in range(args.rounds):  # rotate the order so no configuration always runs first
            for name in names[r % len(names) :] + names[: r % len(names)]:
                results[name].append(run_once(configs[name], args.launches, args.allocs, args.repeats))
    Path(f"/dev/shm/vgpu-bench-{os.getpid()}").unlink(missing_ok=True)
    where = (
        "GPU" if gpu else "stub driver (no GPU): the hook's bookkeeping against a driver that does nothing"
    )
    print(f"bench_hook on {where}; {args.rounds} processes per configuration x {args.repeats} timed loops")
    print(f"{args.launches} empty-kernel launches, {args.allocs} 1 MiB cuMemAlloc+cuMemFree per loop")
    for title, launch_key, alloc_key, pick in (
        ("median of the processes' medians", "launch_us", "alloc_free_us", statistics.median),
        ("best loop of all (least disturbed)", "launch_min_us", "alloc_free_min_us", min),
    ):
        print(f"\n{title}")
        print(
            f"{'configuration':<26} {'launch us':>10} {'overhead':>9} {'alloc+free us':>14} {'overhead':>9}"
        )
        ref_launch = pick(r[launch_key] for r in results["no hook"])
        ref_alloc = pick(r[alloc_key] for r in results["no hook"])
        for name, runs in results.items():
            launch = pick(r[launch_key] for r in runs)
            alloc = pick(r[alloc_key] for r in runs)
            print(
                f"{name:<26} {launch:>10.3f} {100 * (launch / ref_launch - 1):>8.2f}% "
                f"{alloc:>14.3f} {100 * (alloc / ref_alloc - 1):>8.2f}%"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
