"""The node monitor's two passes, on this machine's CPU: what one ``ComputeEnforcer.run_pass``
(the compute gate) and one ``Enforcer.run_pass`` (memory) cost with N processes of one container
on the card (each runs every 100 ms, on a thread of its own).

Each process is a real /proc-shaped folder (cgroup, stat, mountinfo naming the grant as
containerd mounts it) and the grant a real file, so the pass reads what it reads on a node: the
per-PID mapping is cached by start time after the first pass, and the container's grant is read
once per pass. The driver's samples and process list come from a stand-in (no GPU here), every
process within the grant (so the memory pass acts on nothing). Prints the median and p90 of
each pass over ``--passes`` passes, per process count.

    .venv/bin/python bench/bench_monitor.py [--procs 1,30,300] [--passes 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from vgpu.hookabi.grant import Grant, write_grant
from vgpu.monitor.compute import ComputeEnforcer
from vgpu.monitor.enforce import Enforcer
from vgpu.monitor.hostview import HostView
from vgpu.node.discovery import GpuProcess, SmSample
from vgpu.node.paths import HostPaths

CARD = "GPU-bench"
POD = "0f1c2d3e-4a5b-6c7d-8e9f-0a1b2c3d4e5f"
CID = "c" * 64
PASS_NS = 100_000_000


class Samples:
    """Every process busy 10 % of each pass: a container of N processes at its 30 % grant or past it."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.now = 10**12

    def sm_samples(self, uuid: str) -> list[SmSample] | None:
        return [SmSample(pid, self.now, PASS_NS, 10) for pid in self.pids] if uuid == CARD else []

    def processes(self, uuid: str) -> list[GpuProcess]:
        return [GpuProcess(pid, 8 << 20) for pid in self.pids] if uuid == CARD else []


def node(top: Path, procs: int) -> tuple[HostPaths, Path, list[int]]:
    paths = HostPaths(top / "root")
    paths.grants_dir.mkdir(parents=True)
    write_grant(paths.grant(f"{POD}_cuda"), Grant((CARD,), (4 << 30,), sm_limits=(30,)))
    dev = os.stat(paths.grants_dir).st_dev
    here = f"{os.major(dev)}:{os.minor(dev)}"
    mountinfo = (
        "1467 1446 0:279 / / rw,relatime - overlay overlay rw\n"
        f"1476 1467 {here} /var/lib/vgpu/grants/{POD}_cuda.limits /etc/vgpu/limits ro,relatime"
        " - ext4 /dev/x rw\n"
    )
    proc = top / "proc"
    pids = list(range(1000, 1000 + procs))
    for pid in pids:
        d = proc / str(pid)
        d.mkdir(parents=True)
        (d / "cgroup").write_text(f"0::/k8s.io/{CID}\n")
        (d / "stat").write_text(f"{pid} (t) S " + " ".join(["0"] * 18) + f" {1000 + pid} 0 0\n")
        (d / "mountinfo").write_text(mountinfo)
    return paths, proc, pids


def _timed(step: Callable[[], object], passes: int, tick: Callable[[], None]) -> tuple[float, float]:
    times: list[float] = []
    for i in range(passes + 5):
        tick()
        start = time.perf_counter()
        step()
        if i >= 5:  # the first passes read every PID's cgroup and mounts once
            times.append(time.perf_counter() - start)
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.9)]


def bench(procs: int, passes: int) -> dict[str, tuple[float, float]]:
    with tempfile.TemporaryDirectory(prefix="vgpu-bench-monitor-") as tmp:
        paths, proc, pids = node(Path(tmp), procs)
        samples = Samples(pids)

        def tick() -> None:
            samples.now += PASS_NS

        gate_view = HostView("bench", paths, samples, lambda: [CARD], None, proc)  # type: ignore[arg-type]
        gate = ComputeEnforcer(
            "bench", gate_view, samples, lambda: [CARD], action="report", clock=lambda: samples.now
        )
        memory_view = HostView("bench", paths, samples, lambda: [CARD], None, proc)  # type: ignore[arg-type]
        memory = Enforcer("bench", memory_view, "report")
        out = {
            "compute": _timed(gate.run_pass, passes, tick),
            "memory": _timed(memory.run_pass, passes, tick),
        }
        gate.stop()
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", default="1,30,300", help="process counts, comma-separated")
    ap.add_argument("--passes", type=int, default=200)
    args = ap.parse_args()
    print(f"{'processes':>9}  {'pass':>7}  {'median':>8}  {'p90':>8}  {'share of 100 ms':>15}")
    for n in (int(x) for x in args.procs.split(",")):
        for name, (median, p90) in bench(n, args.passes).items():
            share = median / 0.1 * 100
            print(f"{n:>9}  {name:>7}  {median * 1e3:>6.2f}ms  {p90 * 1e3:>6.2f}ms  {share:>14.2f}%")


if __name__ == "__main__":
    main()
