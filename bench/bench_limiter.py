"""What libvgpu's launch path costs a PyTorch loop when no compute limit is set.

Runs tests/gpu/gpu_loops.py (tiny: one-float adds, launch-bound; small: 16 Mi-float adds;
matmul: bf16 8192^2 products) without the hook and with the hook preloaded under a memory limit
and a region file but no SM limit, interleaved over --rounds rounds in alternating order, and
prints the median iterations per second of each and the hook's cost in percent. Target (issue 6):
within 1 % of no hook.

Each loop runs pinned to one CPU (--cpu): a launch-bound Python loop's rate moves by 10-20 %
with the core it lands on, far more than the hook costs. First, the launch call alone on the real
driver (native/hook/build/b_launch: an empty kernel, ns per cuLaunchKernel) bare and preloaded.

    python3 bench/bench_limiter.py [--rounds 6] [--seconds 2] [--cpu 3] [--kinds tiny,small,matmul]
Needs a GPU and torch; builds native/hook first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "native" / "hook"
LOOPS = ROOT / "tests" / "gpu" / "gpu_loops.py"


def rate(kind: str, env: dict[str, str], seconds: float, cpu: int) -> float:
    out = subprocess.run(
        ["taskset", "-c", str(cpu), sys.executable, str(LOOPS), kind, "--seconds", str(seconds)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    ).stdout
    windows = [json.loads(line) for line in out.splitlines() if '"rate"' in line]
    return statistics.fmean(w["rate"] for w in windows[1:])


def main() -> int:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--cpu", type=int, default=3, help="the CPU the loops run on")
    parser.add_argument("--kinds", default="tiny,small,matmul")
    args = parser.parse_args()
    subprocess.run(["make", "-s", "-C", str(HOOK)], check=True, capture_output=True)
    bare = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_DEVICE_", "LD_PRELOAD"))}
    launch = {}
    for name, extra in (("bare", {}), ("hook", {"LD_PRELOAD": str(HOOK / "build" / "libvgpu.so")})):
        with tempfile.TemporaryDirectory() as tmp:
            region = {"CUDA_DEVICE_MEMORY_SHARED_CACHE": str(Path(tmp) / "region")}
            env = bare | extra | (region if extra else {})
            out = subprocess.run(
                ["taskset", "-c", str(args.cpu), str(HOOK / "build" / "b_launch"), "200000", "9"],
                env=env,
                capture_output=True,
                text=True,
                check=True,
                timeout=300,
            ).stdout
        launch[name] = float(dict(line.split("=", 1) for line in out.splitlines())["launch_ns"])
    print(f"cuLaunchKernel, empty kernel: bare {launch['bare']:.0f} ns, hook {launch['hook']:.0f} ns")
    print(f"{'loop':<8} {'bare it/s':>12} {'hook it/s':>12} {'cost':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        hook = bare | {
            "LD_PRELOAD": str(HOOK / "build" / "libvgpu.so"),
            "CUDA_DEVICE_MEMORY_LIMIT": "16g",
            "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(Path(tmp) / "region"),
        }
        for kind in args.kinds.split(","):
            got: dict[str, list[float]] = {"bare": [], "hook": []}
            for rnd in range(args.rounds):
                order = ("bare", "hook") if rnd % 2 == 0 else ("hook", "bare")
                for name in order:
                    got[name].append(rate(kind, bare if name == "bare" else hook, args.seconds, args.cpu))
            b, h = statistics.median(got["bare"]), statistics.median(got["hook"])
            print(f"{kind:<8} {b:>12.1f} {h:>12.1f} {100 * (1 - h / b):>6.2f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
