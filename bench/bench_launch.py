"""What an SM cap adds to a kernel launch: ns per empty-kernel cuLaunchKernel, bare, through the hook
without a cap, and through the hook under caps, interleaved.

Runs native/hook's b_launch (driver API, linked like any CUDA program; the launch loop alone is
timed, the queue is drained between loops) once per configuration per round, the order rotated
by one each round so that no configuration always meets the machine's good or bad moments. Each
process prints the median of its loops; the table gives the median and the 90th percentile of
those over the rounds, and the overhead of the medians against bare. Every hooked configuration
uses a region file, and the table shows the time its launches waited for the limit (`throttled`):
a run that waited measured the limit doing its job, not the hook's cost. Issue 23's targets:
capped within 10 % of bare, no cap within the noise.

Without --gpu it runs over the stub driver (native/hook/build/stub), whose launch is nearly free,
so the hook's own work shows at full size; with --gpu over the machine's real driver, and it says
which card. --hook picks another libvgpu.so (for a before/after on one machine).

--mps adds rows under an MPS grant (docs/mps.md) at each cap: the hook makes the process an MPS
client and keeps its limiter out of the launches (the driver's thread percentage holds compute),
so these rows should cost what "no cap" costs. Over the stub a socket of this script's stands in
for the MPS control daemon; with --gpu, --mps-pipe names a running daemon's pipe folder.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from vgpu.hookabi.grant import Grant, write_grant
from vgpu.hookabi.layout import SHARING_MPS

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "native" / "hook"
BUILD = HOOK / "build"


def device_name() -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise SystemExit("--gpu: nvidia-smi is not on PATH; run without --gpu for the stub driver")
    out = subprocess.run(
        [smi, "--query-gpu=name,driver_version", "--format=csv,noheader", "-i", "0"],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0 or not out.stdout.strip():
        raise SystemExit(f"--gpu: nvidia-smi finds no GPU ({out.stderr.strip()}); run without --gpu")
    name, _, driver = out.stdout.strip().partition(",")
    return f"{name.strip()} (driver {driver.strip()})"


def run_once(env: dict[str, str], launches: int, repeats: int, burst: int) -> dict[str, float]:
    region = env.get("CUDA_DEVICE_MEMORY_SHARED_CACHE")
    if region:
        Path(region).unlink(missing_ok=True)  # a fresh bucket and fresh counters each process
    proc = subprocess.run(
        [str(BUILD / "b_launch"), str(launches), str(repeats), str(burst)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    values = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    if proc.returncode != 0 or "error" in values:
        why = values.get("error", "")
        raise SystemExit(f"b_launch failed ({proc.returncode}): {why} {proc.stderr.strip()}")
    return {key: float(value) for key, value in values.items()}


def mps_grant(folder: Path, pipe: Path, cap: int) -> str:
    """A grant file for an MPS client at ``cap`` % of the threads, no memory limit, no reserve."""
    path = folder / f"grant-mps-{cap}"
    grant = Grant(
        ("GPU-bench-0",),
        (0,),
        (cap,),
        region_path=str(folder / "region"),
        context_reserve=0,
        sharing=SHARING_MPS,
        mps_pipe=str(pipe),
    )
    write_grant(path, grant)
    return str(path)


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="the machine's real driver, not the stub")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--launches", type=int, default=0, help="per loop (200000 stub, 50000 GPU)")
    parser.add_argument("--repeats", type=int, default=3, help="timed loops per process (median)")
    parser.add_argument(
        "--burst",
        type=int,
        default=100,
        help="launches per timed burst, each followed by a pause twice its length (0: back to back)",
    )
    parser.add_argument("--caps", default="99,50", help="SM limits to run, comma-separated percents")
    parser.add_argument("--hook", type=Path, default=BUILD / "libvgpu.so", help="the libvgpu.so to preload")
    parser.add_argument(
        "--compare", type=Path, help="a second libvgpu.so (say, before a change), its rows interleaved too"
    )
    parser.add_argument("--mps", action="store_true", help="also rows under an MPS grant at each cap")
    parser.add_argument("--mps-pipe", type=Path, help="with --gpu --mps: a running MPS daemon's pipe folder")
    args = parser.parse_args()
    if args.mps and args.gpu and args.mps_pipe is None:
        raise SystemExit("--gpu --mps: name the pipe folder of a running MPS control daemon with --mps-pipe")
    caps = [int(c) for c in args.caps.split(",") if c.strip()]
    if any(not 0 < c < 100 for c in caps):
        raise SystemExit(f"--caps: {args.caps!r}: each cap is a percent from 1 to 99")
    launches = args.launches or (50000 if args.gpu else 200000)
    subprocess.run(["make", "-s", "-C", str(HOOK)], check=True)
    hook = args.hook.resolve()
    if not hook.is_file():
        raise SystemExit(f"--hook: {hook} does not exist")
    other = args.compare.resolve() if args.compare else None
    if other is not None and not other.is_file():
        raise SystemExit(f"--compare: {other} does not exist")
    stub = "the stub driver (no GPU): the hook's own work against a free launch"
    where = device_name() if args.gpu else stub
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "LD_PRELOAD", "VGPU_"))}
    if not args.gpu:
        base["LD_LIBRARY_PATH"] = str(BUILD / "stub")
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
        configs = {"bare": base}
        for label, lib in (("hook", hook), ("compare", other)):
            if lib is None:
                continue
            hooked = base | {
                "LD_PRELOAD": str(lib),
                "VGPU_CONTEXT_RESERVE": "0",
                "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(Path(tmp) / "region"),
            }
            configs[f"{label}, no cap"] = hooked
            for cap in caps:
                configs[f"{label}, cap {cap} %"] = hooked | {"CUDA_DEVICE_SM_LIMIT": str(cap)}
        listener = None
        if args.mps:
            pipe = args.mps_pipe
            if pipe is None:  # the stub: a listening socket is all an MPS client asks at cuInit
                pipe = Path(tmp) / "mps"
                pipe.mkdir()
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                listener.bind(str(pipe / "control"))
                listener.listen(128)
            for cap in caps:
                configs[f"hook, MPS {cap} %"] = base | {
                    "LD_PRELOAD": str(hook),
                    "VGPU_GRANT_FILE": mps_grant(Path(tmp), pipe, cap),
                    "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(Path(tmp) / "region"),
                }
        names = list(configs)
        results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                results[name].append(run_once(configs[name], launches, args.repeats, args.burst))
        if listener is not None:
            listener.close()
    print(f"bench_launch on {where}")
    print(f"hook {hook}" + (f", compare {other}" if other else ""))
    print(f"{args.rounds} rounds, interleaved; per process {args.repeats} loops of {launches} launches")
    pace = "back to back"
    if args.burst:
        pace = f"in bursts of {args.burst}, each followed by a pause twice its length"
    print(f"launches {pace}; only the launch calls are timed")
    waited = "throttled ms, median / max"
    print(f"\n{'configuration':<21} {'median ns':>10} {'p90 ns':>10} {'overhead':>9} {waited:>28}")
    ref = statistics.median(r["launch_ns"] for r in results["bare"])
    for name in names:
        per = [r["launch_ns"] for r in results[name]]
        med = statistics.median(per)
        waits = [r.get("throttled_ns", 0.0) / 1e6 for r in results[name]]
        shown = f"{statistics.median(waits):.1f} / {max(waits):.1f}" if name != "bare" else "-"
        shown = f"{shown:>28}"
        print(f"{name:<21} {med:>10.1f} {p90(per):>10.1f} {100 * (med / ref - 1):>8.1f}% {shown}")
    print("\nthrottled: how long a process of the row waited for its limit (0: the cost is the hook's own)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
