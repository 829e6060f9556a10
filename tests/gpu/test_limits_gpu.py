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
from gpu_figures import record

from vgpu.region import Region

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "native" / "hook"
LOOPS = Path(__file__).with_name("gpu_loops.py")
GIB = 1 << 30


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


def run_loop(kind: str, env: dict[str, str], seconds: float = 6.0) -> float:
    child = loop(kind, env, seconds)
    windows = child.windows()
    assert child.finish() == 0
    return steady_rate(windows)


@pytest.mark.parametrize("kind", ["matmul", "small"])
def test_sm_limit_holds_the_loop_to_its_share(lib: Path, tmp_path: Path, kind: str) -> None:
    bare = run_loop(kind, plain_env())
    achieved = {}
    for pct in (25, 50, 75):
        env = hook_env(lib, tmp_path / f"region-{pct}", CUDA_DEVICE_SM_LIMIT=str(pct))
        achieved[pct] = 100.0 * run_loop(kind, env) / bare
    errors = {pct: abs(got - pct) for pct, got in achieved.items()}
    mae = statistics.fmean(errors.values())
    record(f"sm-limit-{kind}", bare_rate=bare, achieved_pct=achieved, error_pts=errors, mae_pts=mae)
    assert mae <= 3.0, f"mean absolute error {mae:.1f} points: {achieved}"
    assert max(errors.values()) <= 5.0, f"an error over 5 points: {achieved}"


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
    for child in children.values():
        child.send()
    shares = {pct: 100.0 * steady_rate(child.windows()) / bare for pct, child in children.items()}
    for child in children.values():
        assert child.finish() == 0
    record("sm-two-containers", bare_rate=bare, shares_pct=shares, total_pct=sum(shares.values()))
    assert shares[30] <= 35.0 and shares[70] <= 75.0, shares
    assert shares[30] < shares[70]
    assert sum(shares.values()) >= 80.0, f"the two containers left the card idle: {shares}"


def test_sm_limit_changes_on_a_running_process(lib: Path, tmp_path: Path) -> None:
    bare = run_loop("matmul", plain_env())
    region = tmp_path / "region"
    child = loop("matmul", hook_env(lib, region, CUDA_DEVICE_SM_LIMIT="25"), seconds=10.0, wait=True)
    child.send()
    switch_at = time.clock_gettime_ns(time.CLOCK_MONOTONIC) + 5 * 10**9
    windows = []
    switched = False
    while (r := child.read()) is not None:
        windows.append(r)
        if not switched and r["t"] >= switch_at:
            with Region(region, writable=True) as reg:
                reg.set_sm_limit(0, 75)
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
    from vgpu.plugin.arbiter import Arbiter

    containers = tmp_path / "containers"
    for name in ("low", "high"):
        (containers / name).mkdir(parents=True)
    env = {
        p: hook_env(lib, containers / name / "vgpu.region", CUDA_TASK_PRIORITY=str(p))
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
    alone = rate_between(low_windows, low_windows[0]["t"], high_start)
    during = rate_between(low_windows, high_start + 10**9, high_end)
    after = rate_between(low_windows, high_end + 10**9, low_windows[-1]["t"])
    high_rate = steady_rate(high_windows, skip=1)
    figures = {
        "low_alone": alone,
        "low_during_high": during,
        "low_after": after,
        "high_during": high_rate,
        "arbiter_passes": arbiter.stats.passes,
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
    region = tmp_path / "region"
    child = memory_child(hook_env(lib, region, CUDA_DEVICE_MEMORY_LIMIT="8g"))
    try:
        held = [ask(child, f"alloc t{i} 1") for i in range(6)]
        with Region(region, writable=True) as r:
            r.set_limit(0, 4 * GIB)
        refused = ask(child, "alloc x 1")
        intact = ask(child, "check")
        ask(child, "free t0 t1 t2 t3 t4")
        after_free = ask(child, "alloc y 1")
        with Region(region, writable=True) as r:
            r.set_limit(0, 8 * GIB)
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
