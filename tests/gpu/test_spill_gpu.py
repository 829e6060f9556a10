"""libvgpu's virtual device memory on a real GPU: past a 4 GiB device budget, memory is served
from pinned host memory mapped into the GPU, kernels read and write it, and a limit lowered and
raised at run time takes effect at the next allocation.

Run on the GPU machine with `python3 -m pytest -m gpu tests/gpu/test_spill_gpu.py`. Set
VGPU_GPU_REPORT to a folder to get the figures written there as JSON lines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_figures import record

from vgpu.hookabi.region import Region

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "native" / "hook"
BUILD = HOOK / "build"
MIB, GIB = 1 << 20, 1 << 30
OUT_OF_MEMORY = 2

TORCH = r"""
import json, sys, torch
def report(**kw): print(json.dumps(kw), flush=True)
def wait(): sys.stdin.readline()
def gsum(x):  # summed in 64 MiB pieces: a whole int32 sum makes an int64 copy (2 GiB per GiB)
    return sum(int(c.sum().item()) for c in x.split(1 << 24))
n = (1 << 30) // 4  # int32 elements in 1 GiB
free, total = torch.cuda.mem_get_info()
report(stage="start", free=free, total=total)
xs = [torch.full((n,), i + 1, dtype=torch.int32, device="cuda") for i in range(6)]  # kernels write
y = xs[5] * 2  # a kernel reads spilled memory and writes more of it
sums = [gsum(x) for x in xs]
ok = sums == [(i + 1) * n for i in range(6)] and gsum(y) == 12 * n
del y
torch.cuda.empty_cache()
h = torch.arange(n, dtype=torch.int32)
d = h.to("cuda")  # a copy engine writes spilled memory, and reads it back
copied = bool(torch.equal(d.cpu(), h))
del d
torch.cuda.empty_cache()
report(stage="held", ok=ok, copied=copied, reserved=torch.cuda.memory_reserved())
wait()  # the limit is now below what is held
try:
    z = torch.empty(n, dtype=torch.int32, device="cuda")
    err = None
except torch.cuda.OutOfMemoryError as e:
    err = type(e).__name__
sums = [int(x.cpu().sum()) for x in xs]  # on the host: below the limit no kernel may allocate
report(stage="shrunk", error=err, ok=sums == [(i + 1) * n for i in range(6)])
wait()  # raised again
z = torch.ones(n, dtype=torch.int32, device="cuda")
report(stage="grown", ok=gsum(z) == n)
wait()
"""


@pytest.fixture(scope="module")
def built() -> Path:
    targets = ["build/libvgpu.so", "build/tests/t_spill", "build/b_spill"]
    subprocess.run(["make", "-s", "-C", str(HOOK), *targets], check=True, capture_output=True, timeout=300)
    return BUILD


def plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "LD_PRELOAD", "VGPU_"))}


def vmem_env(built: Path, region: Path, **extra: str) -> dict[str, str]:
    return plain_env() | {
        "LD_PRELOAD": str(built / "libvgpu.so"),
        "CUDA_DEVICE_MEMORY_LIMIT": "8g",
        "CUDA_DEVICE_MEMORY_BUDGET": "4g",
        "CUDA_OVERSUBSCRIBE": "true",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region),
        **extra,
    }


def real_usage_mib(pid: int) -> int:
    """What the driver says the process holds on the card (nvidia-smi run without the hook)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        env=plain_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sum(int(u) for p, u in (line.split(", ") for line in out.splitlines() if line) if int(p) == pid)


def usage(region: Path) -> tuple[int, int]:
    with Region(region) as r:
        d = r.snapshot().devices[0]
    return d.used_bytes, d.spilled_bytes


class Proc:
    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def line(self) -> str:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        out = self.proc.stdout.readline()
        if not out:
            self.proc.wait(timeout=60)
            raise AssertionError(f"exited {self.proc.returncode}: {self.proc.stderr.read()[-3000:]}")
        return out

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def cmd(self, command: str) -> dict[str, int]:
        self.send(command)
        return kv(self.line())

    def end(self) -> str:
        assert self.proc.stdin is not None and self.proc.stderr is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        return self.proc.stderr.read()


def kv(line: str) -> dict[str, int]:
    return {k: int(v) for k, v in (part.split("=", 1) for part in line.split())}


def test_the_driver_api_spills_past_the_budget_and_the_data_reads_back(built: Path, tmp_path: Path) -> None:
    region = tmp_path / "region"
    p = Proc(
        [str(built / "tests" / "t_spill"), "procaddr"], vmem_env(built, region, VGPU_CONTEXT_RESERVE="0")
    )
    try:
        assert kv(p.line())["ready"] == 1
        got = [p.cmd("alloc 1024") for _ in range(6)]
        assert [(a["rc"], a["write"]) for a in got] == [(0, 0)] * 6
        assert usage(region) == (6 * GIB, 2 * GIB)
        real = real_usage_mib(p.proc.pid)
        assert 4096 <= real < 4096 + 1024, real  # 4 GiB on the card plus the bare context
        assert p.cmd("check") == {"ok": 6, "bad": 0}
        info = p.cmd("info")
        assert (info["free"], info["total"]) == (2 * GIB, 8 * GIB)
        with Region(region, writable=True) as r:
            r.set_limit(0, 4 * GIB)
        assert p.cmd("alloc 1024")["rc"] == OUT_OF_MEMORY
        assert p.cmd("check") == {"ok": 6, "bad": 0}
        with Region(region, writable=True) as r:
            r.set_limit(0, 8 * GIB)
        assert p.cmd("alloc 1024")["rc"] == 0
        assert usage(region) == (7 * GIB, 3 * GIB)
        pitched = p.cmd("pitch 512")  # 512 rows of 1 MiB, past the budget: spilled with our pitch
        assert (pitched["rc"], pitched["write"], pitched["pitch"]) == (0, 0, MIB)
        assert usage(region) == (7 * GIB + 512 * MIB, 3 * GIB + 512 * MIB)
        assert p.cmd("check") == {"ok": 8, "bad": 0}
        assert all(p.cmd(f"free {i}")["rc"] == 0 for i in range(8))
        assert usage(region) == (0, 0)
        record("spill-driver-api", real_mib_with_6gib_held=real)
    finally:
        p.end()


def test_pytorch_writes_and_reads_6_gib_under_a_4_gib_budget_and_follows_a_live_resize(
    built: Path, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    region = tmp_path / "region"
    p = Proc([sys.executable, "-c", TORCH], vmem_env(built, region))
    try:
        start = json.loads(p.line())
        assert start["total"] == 8 * GIB
        held = json.loads(p.line())
        assert held["ok"] and held["copied"], held
        used, spilled = usage(region)
        real = real_usage_mib(p.proc.pid)
        assert used - spilled <= 4 * GIB and spilled >= 3 * GIB, (used, spilled)
        with Region(region, writable=True) as r:
            r.set_limit(0, 4 * GIB)
        p.send("")
        shrunk = json.loads(p.line())
        assert shrunk == {"stage": "shrunk", "error": "OutOfMemoryError", "ok": True}
        with Region(region, writable=True) as r:
            r.set_limit(0, 8 * GIB)
        p.send("")
        assert json.loads(p.line()) == {"stage": "grown", "ok": True}
        record("spill-torch", used_mib=used // MIB, spilled_mib=spilled // MIB, real_mib=real)
        p.send("")
    finally:
        log = p.end()
    assert "spilling to mapped host memory" in log


def test_spill_costs(built: Path, tmp_path: Path) -> None:
    """Figures only: allocation+free on the device and spilled, and a kernel's read bandwidth."""
    out = subprocess.run(
        [str(built / "b_spill"), "64", "50", "5", "1024"],
        env=vmem_env(built, tmp_path / "region", CUDA_DEVICE_MEMORY_LIMIT="16g"),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    figures = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert figures.get("read_sum_ok") == "1", out
    record("spill-costs", **figures)
