"""libvgpu part 2 on a real GPU: compute limits, two containers' shares, priority and live resize,
with PyTorch (virtual device memory has its own file, test_spill_gpu.py).

Run on the GPU machine with `python3 -m pytest -m gpu tests/gpu`. With VGPU_GPU_REPORT set to a
folder, the measured figures are appended there as JSON lines (gpu_figures.jsonl).
"""

from __future__ import annotations

import json
import os
import selectors
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from gpu_figures import Clocks, record

from vgpu.hookabi.region import Region

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "native" / "hook"
LOOPS = Path(__file__).with_name("gpu_loops.py")


@pytest.fixture(scope="module")
def lib() -> Path:
    subprocess.run(["make", "-s", "-C", str(HOOK)], check=True, capture_output=True, timeout=300)
    return HOOK / "build" / "libvgpu.so"


def plain_env() -> dict[str, str]:
    return {
        k: v for k, v in os.environ.items() if not k.startswith(("CUDA_DEVICE_", "CUDA_SM_", "LD_PRELOAD"))
    }


def hook_env(lib: Path, region: Path, **extra: str) -> dict[str, str]:
    return plain_env() | {"LD_PRELOAD": str(lib), "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region)} | extra


class Child:
    """A child process that speaks JSON lines on stdout and takes lines on stdin."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, *argv],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)

    def read(self, timeout: float = 180) -> dict[str, Any] | None:
        """The next report, or None at the end of the output."""
        assert self.proc.stdout is not None
        if not self.sel.select(timeout):
            self.proc.kill()
            raise AssertionError(f"{self.proc.args}: no report within {timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=60)
            if self.proc.returncode != 0:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise AssertionError(f"{self.proc.args} exited {self.proc.returncode}: {err[-3000:]}")
            return None
        report: dict[str, Any] = json.loads(line)
        return report

    def send(self, line: str = "") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def windows(self) -> list[dict[str, Any]]:
        out = []
        while (r := self.read()) is not None:
            if "rate" in r:
                out.append(r)
        return out

    def finish(self) -> int:
        try:
            return self.proc.wait(timeout=120)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def loop(kind: str, env: dict[str, str], seconds: float = 6.0, wait: bool = False) -> Child:
    argv = [str(LOOPS), kind, "--seconds", str(seconds)] + (["--wait-stdin"] if wait else [])
    child = Child(argv, env)
    ready = child.read()
    assert ready == {"ready": True}, ready
    return child


def steady_rate(windows: list[dict[str, Any]], skip: int = 2) -> float:
    """Mean rate over the windows after the first `skip` (the limiter's burst and ramp)."""
    rates = [w["rate"] for w in windows[skip:]]
    assert rates, "the loop reported too few windows"
    return statistics.fmean(rates)


def rate_between(windows: list[dict[str, Any]], a: int, b: int) -> float:
    """Iterations per second between monotonic times a and b (ns), spreading each window's work
    evenly over it (a window ends at its "t" and starts at the previous window's)."""
    work = 0.0
    for prev, w in zip(windows, windows[1:], strict=False):
        lo, hi = max(prev["t"], a), min(w["t"], b)
        if hi > lo:
            work += w["rate"] * (hi - lo) / 1e9
    return work / ((b - a) / 1e9)


def limits_set(container_dir: Path, *args: str) -> None:
    """`vgpu limits set` as an operator runs it on the node (the monitor's code path)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "vgpu.commands.cli",
            "limits",
            "set",
            "--container-dir",
            str(container_dir),
            "--device",
            "0",
        ]
        + list(args),
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        check=True,
        capture_output=True,
        timeout=60,
    )


def card_uuid() -> str:
    """The UUID of the card the loops run on (CUDA device 0), as NVML spells it."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    assert out and out[0].startswith("GPU-"), out
    return out[0]


def run_loop(kind: str, env: dict[str, str], seconds: float = 6.0) -> float:
    child = loop(kind, env, seconds)
    windows = child.windows()
    assert child.finish() == 0
    return steady_rate(windows)


def busy_ns(region: Path) -> int:
    with Region(region) as r:
        return r.snapshot().devices[0].busy_ns


def measured_run(kind: str, env: dict[str, str], region: Path | None, seconds: float = 6) -> dict[str, float]:
    """The loop's steady rate; the share of the loop's wall time (from the go to its last
    window's end, its last sync) that its GPU work took as the hook measured it (busy_ns, read
    after the process is gone, so every interval is in); and the card's median SM clock and
    power while the loop ran."""
    child = loop(kind, env, seconds, wait=True)
    busy0 = busy_ns(region) if region else 0
    with Clocks() as clocks:
        t0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        child.send()
        windows = child.windows()
    assert child.finish() == 0
    run = {"rate": steady_rate(windows), "sm_mhz": clocks.sm_mhz, "power_w": clocks.power_w}
    if region:
        run["time_pct"] = 100.0 * (busy_ns(region) - busy0) / (windows[-1]["t"] - t0)
    return run


@pytest.mark.parametrize("kind", ["matmul", "small"])
def test_sm_limit_holds_the_loop_to_its_share(lib: Path, tmp_path: Path, kind: str) -> None:
    bare_run = measured_run(kind, plain_env(), None)
    bare = bare_run["rate"]
    achieved, runs = {}, {}
    for pct in (25, 50, 75):
        region = tmp_path / f"region-{pct}"
        runs[pct] = measured_run(kind, hook_env(lib, region, CUDA_DEVICE_SM_LIMIT=str(pct)), region)
        achieved[pct] = 100.0 * runs[pct]["rate"] / bare
    errors = {pct: abs(got - pct) for pct, got in achieved.items()}
    mae = statistics.fmean(errors.values())
    record(
        f"sm-limit-{kind}",
        bare_rate=bare,
        bare_sm_mhz=bare_run["sm_mhz"],
        bare_power_w=bare_run["power_w"],
        achieved_pct=achieved,
        error_pts=errors,
        mae_pts=mae,
        runs=runs,
        time_error_pts={pct: abs(run["time_pct"] - pct) for pct, run in runs.items()},
    )
    # what the limiter holds: the share of the card's time the loop's work takes
    for pct, run in runs.items():
        assert abs(run["time_pct"] - pct) <= 3.0, f"time share {run['time_pct']:.1f} % at a {pct} % limit"
    if kind == "small":  # memory-bound: its throughput follows its time share
        assert mae <= 3.0, f"mean absolute error {mae:.1f} points: {achieved}"
        assert max(errors.values()) <= 5.0, f"an error over 5 points: {achieved}"
    else:
        # A compute-bound bf16 matmul holds the bare card at its power limit, below top clocks,
        # while a capped loop leaves the card cool enough to run at them: the same time share
        # then buys more work. The throughput may exceed the cap by no more than the clock gain.
        for pct, run in runs.items():
            gain = run["sm_mhz"] / bare_run["sm_mhz"]
            assert pct - 5.0 <= achieved[pct] <= pct * gain + 5.0, (pct, achieved[pct], gain)


def test_two_containers_at_30_and_70_percent_share_the_card(lib: Path, tmp_path: Path) -> None:
    bare = run_loop("matmul", plain_env())
    children = {
        pct: loop(
            "matmul",
            hook_env(lib, tmp_path / f"c{pct}", CUDA_DEVICE_SM_LIMIT=str(pct)),
            seconds=8.0,
            wait=True,
        )
        for pct in (30, 70)
    }
    t0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    for child in children.values():
        child.send()
    windows = {pct: child.windows() for pct, child in children.items()}
    for child in children.values():
        assert child.finish() == 0
    shares = {pct: 100.0 * steady_rate(w) / bare for pct, w in windows.items()}
    # the hook's own measure: each one's GPU time over the run (time-slicing between the two
    # contexts counts in both, so under contention each is held a little below its cap)
    time_pct = {pct: 100.0 * busy_ns(tmp_path / f"c{pct}") / (w[-1]["t"] - t0) for pct, w in windows.items()}
    record(
        "sm-two-containers",
        bare_rate=bare,
        shares_pct=shares,
        total_pct=sum(shares.values()),
        time_pct=time_pct,
    )
    assert shares[30] <= 35.0 and shares[70] <= 75.0, shares
    assert shares[30] < shares[70]
    assert sum(shares.values()) >= 80.0, f"the two containers left the card idle: {shares}"


def test_sm_limit_changes_on_a_running_process(lib: Path, tmp_path: Path) -> None:
    # the small-kernel loop: its throughput follows its time share, whatever the card's clocks
    bare = run_loop("small", plain_env())
    region = tmp_path / "vgpu.region"
    child = loop("small", hook_env(lib, region, CUDA_DEVICE_SM_LIMIT="25"), seconds=10.0, wait=True)
    child.send()
    switch_at = time.clock_gettime_ns(time.CLOCK_MONOTONIC) + 5 * 10**9
    windows = []
    switched = False
    while (r := child.read()) is not None:
        windows.append(r)
        if not switched and r["t"] >= switch_at:
            limits_set(tmp_path, "--cores", "75")
            switched_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            switched = True
    assert child.finish() == 0
    assert switched
    before = [w for w in windows if w["t"] < switch_at]
    after = [w for w in windows if w["t"] > switched_ns + 10**9]
    at25 = 100.0 * steady_rate(before) / bare
    at75 = 100.0 * steady_rate(after, skip=0) / bare
    record("sm-live-resize", bare_rate=bare, before_pct=at25, after_pct=at75)
    assert abs(at25 - 25) <= 5.0 and abs(at75 - 75) <= 5.0, (at25, at75)


def test_priority_1_yields_while_priority_0_is_busy_and_resumes_after(lib: Path, tmp_path: Path) -> None:
    from vgpu.monitor.arbiter import Arbiter

    containers = tmp_path / "containers"
    for name in ("low", "high"):
        (containers / name).mkdir(parents=True)
    # the arbiter groups containers by the card's UUID, which the hook takes from
    # NVIDIA_VISIBLE_DEVICES as the device plugin sets it: without it nobody is on a known card
    uuid = card_uuid()
    env = {
        p: hook_env(
            lib, containers / name / "vgpu.region", CUDA_TASK_PRIORITY=str(p), NVIDIA_VISIBLE_DEVICES=uuid
        )
        for p, name in ((1, "low"), (0, "high"))
    }
    arbiter = Arbiter(containers)
    arbiter.start()
    try:
        low = loop("matmul", env[1], seconds=14.0, wait=True)
        high = loop("matmul", env[0], seconds=5.0, wait=True)
        low.send()
        time.sleep(4.0)
        high_start = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        high.send()
        high_windows = high.windows()
        high_end = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        low_windows = low.windows()
        assert high.finish() == 0 and low.finish() == 0
    finally:
        arbiter.stop()
    # "during" ends where the priority-0 loop's last window ends, not when its process is gone:
    # tearing its context down takes a second in which it launches nothing and low may run
    high_stop = high_windows[-1]["t"]
    alone = rate_between(low_windows, low_windows[0]["t"], high_start)
    during = rate_between(low_windows, high_start + 10**9, high_stop)
    after = rate_between(low_windows, high_end + 10**9, low_windows[-1]["t"])
    high_rate = steady_rate(high_windows, skip=1)
    figures = {
        "low_alone": alone,
        "low_during_high": during,
        "low_after": after,
        "high_during": high_rate,
        "arbiter_passes": arbiter.stats.passes,
        "regions_seen": arbiter.stats.regions,
    }
    record("priority", **figures)
    assert figures["low_during_high"] <= 0.1 * figures["low_alone"], figures
    assert figures["low_after"] >= 0.8 * figures["low_alone"], figures
    assert high_rate >= 0.8 * figures["low_alone"], figures


MEMORY_SCRIPT = r"""
import json, sys, torch
held = {}
def report(**kw):
    print(json.dumps(kw), flush=True)
torch.zeros(1, device="cuda")
report(ready=True)
for line in sys.stdin:
    cmd, *arg = line.split()
    if cmd == "alloc":  # alloc NAME GIB: an int32 tensor holding its own index plus a seed
        name, gib = arg[0], int(arg[1])
        try:
            n = gib << 28
            t = torch.arange(n, device="cuda", dtype=torch.int32)
            t += hash(name) % 1000
            held[name] = t
            report(ok=True, name=name)
        except torch.cuda.OutOfMemoryError as e:
            report(ok=False, name=name, error=type(e).__name__)
    elif cmd == "check":  # every tensor still holds what was written, compared on the host:
        bad = []            # a check must not take device memory (the limit may be below usage)
        for k, t in held.items():
            for s in range(0, t.numel(), 1 << 26):
                part = t[s:s + (1 << 26)].cpu()
                if not bool((part - torch.arange(s, s + part.numel(), dtype=torch.int32)
                             == hash(k) % 1000).all()):
                    bad.append(k)
                    break
        report(ok=not bad, bad=bad, tensors=len(held))
    elif cmd == "free":
        for name in arg:
            held.pop(name, None)
        torch.cuda.empty_cache()
        report(ok=True)
    elif cmd == "quit":
        break
"""


def memory_child(env: dict[str, str]) -> Child:
    child = Child(["-c", MEMORY_SCRIPT], env | {"PYTHONHASHSEED": "0"})
    assert child.read() == {"ready": True}
    return child


def ask(child: Child, line: str) -> dict[str, Any]:
    child.send(line)
    r = child.read()
    assert r is not None
    return r


def test_without_oversubscribe_the_same_request_is_refused(lib: Path, tmp_path: Path) -> None:
    env = hook_env(lib, tmp_path / "region", CUDA_DEVICE_MEMORY_LIMIT="4g")
    child = memory_child(env)
    try:
        got = [ask(child, f"alloc t{i} 1") for i in range(6)]
        child.send("quit")
    finally:
        child.finish()
    record("vmem-off", allocs=[g["ok"] for g in got])
    assert [g["ok"] for g in got][:3] == [True, True, True]
    assert not got[-1]["ok"] and got[-1]["error"] == "OutOfMemoryError"


def test_memory_limit_shrinks_and_grows_on_a_running_process(lib: Path, tmp_path: Path) -> None:
    region = tmp_path / "vgpu.region"
    child = memory_child(hook_env(lib, region, CUDA_DEVICE_MEMORY_LIMIT="8g"))
    try:
        held = [ask(child, f"alloc t{i} 1") for i in range(6)]
        limits_set(tmp_path, "--memory", "4096")
        refused = ask(child, "alloc x 1")
        intact = ask(child, "check")
        ask(child, "free t0 t1 t2 t3 t4")
        after_free = ask(child, "alloc y 1")
        limits_set(tmp_path, "--memory", "8192")
        grown = [ask(child, f"alloc g{i} 1") for i in range(4)]
        final = ask(child, "check")
        child.send("quit")
    finally:
        child.finish()
    record(
        "memory-live-resize",
        held=[h["ok"] for h in held],
        refused_after_shrink=not refused["ok"],
        intact=intact["ok"],
        after_free=after_free["ok"],
        grown=[g["ok"] for g in grown],
        final_ok=final["ok"],
    )
    assert all(h["ok"] for h in held)
    assert not refused["ok"] and refused["error"] == "OutOfMemoryError"
    assert intact["ok"] and intact["tensors"] == 6
    assert after_free["ok"]
    assert all(g["ok"] for g in grown)
    assert final["ok"]
