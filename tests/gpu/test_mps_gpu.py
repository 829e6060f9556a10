"""MPS mode on a real GPU (docs/mps.md): libvgpu under an MPS grant, with a real MPS control daemon.

The module starts ``nvidia-cuda-mps-control -d`` on card 0 with its own pipe and log folders under
a temporary folder (as the node agent does per MPS card) and always stops it after (``quit``
through the same pipe, then the daemon's pid if it lingers); it never changes the card's settings
(no compute mode, no MIG), never uses managed memory and never asks for more than the card holds.
Each process runs under libvgpu with an MPS grant naming that pipe (``VGPU_GRANT_FILE``).

Under MPS, the memory rows the other GPU modules prove without it:
- PyTorch is an MPS client (NVML lists it among the card's MPS processes; the plain compute list
  holds every process of the card, the MPS server and its clients too, as driver 580 reports),
  gets the grant's thread percentage and pinned limit even when it unset or raised them itself
  before CUDA started, and is held to its memory limit with its own out-of-memory error;
- two processes of one grant share one limit;
- past the hook (``t_bypass``: the real libcuda in a new link-map namespace) a process that keeps
  the pipe is an MPS client the driver holds to the pinned limit; one that drops the pipe is a
  plain process, which NVML lists as such, and the node's second line kills it past its grant.

A missing ``nvidia-cuda-mps-control``, PyTorch or pynvml makes each test fail saying so
(``VGPU_GPU_REQUIRED``, tests/support/skips.py). Part d of tests/gpu/procedure.py.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gpu_figures import record

from vgpu.hookabi.grant import Grant, write_grant
from vgpu.hookabi.layout import SHARING_MPS
from vgpu.hookabi.region import Region
from vgpu.node.mps import accepts

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "native" / "hook"
BUILD = HOOK / "build"
MIB = 1 << 20
LIMIT_MIB = 4096
THREADS = 30
MPS_VARS = (
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
)
CONTROL = "nvidia-cuda-mps-control"

# A PyTorch tenant: changes its MPS variables first (after libvgpu's constructor set them) as a
# tenant may, starts CUDA, says what its environment holds now (libc's, which the driver reads),
# then takes 256 MiB at a time until its own out-of-memory error, and computes on after a free.
SCRIPT = r"""
import ctypes, json, os, sys
mode = sys.argv[1]
libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p
def env(name):
    v = libc.getenv(name.encode())
    return v.decode() if v else None
def report(**kw):
    print(json.dumps(kw), flush=True)
def wait():
    sys.stdin.readline()
NAMES = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
if mode == "unset":
    for n in NAMES:
        os.environ.pop(n, None)
elif mode == "raise":
    os.environ.update(zip(NAMES, ("/tmp/elsewhere", "100", "0=80G")))
import torch
try:
    free, total = torch.cuda.mem_get_info()  # the context: refused by the hook where it does not fit
except RuntimeError as e:
    if mode != "hold3g":
        raise
    report(stage="start", ok=False, error="context", message=str(e))
    wait()
    report(stage="hold", ok=False, error="context", message=str(e))
    wait()
    sys.exit(0)
report(stage="start", total=total, env={n: env(n) for n in NAMES})
wait()
if mode == "hold3g":
    try:
        held = torch.empty(3 << 30, dtype=torch.uint8, device="cuda")
        report(stage="hold", ok=True)
    except torch.cuda.OutOfMemoryError as e:
        report(stage="hold", ok=False, error=type(e).__name__)
    wait()
    sys.exit(0)
held = []
try:
    while True:
        held.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
except torch.cuda.OutOfMemoryError as e:
    err = type(e).__name__
report(stage="oom", error=err, held=len(held) * (256 << 20))
wait()
del held[len(held) // 2:]
torch.cuda.empty_cache()
report(stage="alive", value=float(torch.ones(1 << 20, device="cuda").sum().item()))
"""


def plain_env() -> dict[str, str]:
    drop = ("CUDA_DEVICE_", "CUDA_SM_", "CUDA_MPS_", "LD_PRELOAD", "STUB_CUDA_", "VGPU_")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


class Daemon:
    """An MPS control daemon on one card, with its own pipe and log folders."""

    def __init__(self, binary: str, card: str) -> None:
        self.binary = binary
        self.folder = Path(tempfile.mkdtemp(prefix="vgpu-mps-", dir="/tmp"))  # a socket path is short
        self.pipe, self.log = self.folder / "pipe", self.folder / "log"
        self.pipe.mkdir()
        self.log.mkdir()
        self.env = plain_env() | {
            "CUDA_VISIBLE_DEVICES": card,
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log),
        }

    def start(self) -> None:
        subprocess.run([self.binary, "-d"], env=self.env, check=True, capture_output=True, timeout=30)
        deadline = time.monotonic() + 15
        while not self.answers():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{CONTROL} -d: no control socket in {self.pipe} after 15 s; see {self.log}"
                )
            time.sleep(0.1)

    def answers(self) -> bool:
        return accepts(self.pipe)  # the node agent's own check (driver 580's socket is no stream)

    def ask(self, command: str) -> str:
        out = subprocess.run(
            [self.binary], input=command + "\n", env=self.env, capture_output=True, text=True, timeout=30
        )
        return out.stdout.strip()

    def stop(self) -> None:
        pid_file = self.pipe / "nvidia-cuda-mps-control.pid"
        pid = int(pid_file.read_text()) if pid_file.is_file() else 0
        try:
            self.ask("quit")
        finally:
            deadline = time.monotonic() + 20
            while pid and Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            if pid and Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)  # the daemon this module started, and only it
            shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(scope="module")
def lib() -> Path:
    subprocess.run(["make", "-s", "-C", str(HOOK)], check=True, capture_output=True, timeout=300)
    return BUILD / "libvgpu.so"


@pytest.fixture(scope="module")
def card() -> str:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    assert out and out[0].startswith("GPU-"), out
    return out[0]


@pytest.fixture(scope="module")
def nvml() -> Iterator[Any]:
    try:
        import pynvml
    except ImportError:
        pytest.skip(
            "pynvml is not installed (pip install nvidia-ml-py): the MPS process list is read through it"
        )
    pynvml.nvmlInit()
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


@pytest.fixture(scope="module")
def mps(request: pytest.FixtureRequest) -> Iterator[Daemon]:
    binary = shutil.which(CONTROL)  # asked first: without it nothing here can run
    if binary is None:
        pytest.skip(
            f"{CONTROL} is not on PATH: MPS mode cannot be proved here. It comes with the NVIDIA driver's "
            "utilities (the package that ships nvidia-smi); install them on the GPU machine"
        )
    daemon = Daemon(binary, request.getfixturevalue("card"))
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.stop()


def lists(nvml: Any, card: str) -> tuple[dict[int, int | None], dict[int, int | None]]:
    """The card's (plain compute, MPS compute) processes by NVML: pid -> used bytes (None: not told)."""
    handle = nvml.nvmlDeviceGetHandleByUUID(card)
    plain = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    mps = nvml.nvmlDeviceGetMPSComputeRunningProcesses(handle)
    return ({p.pid: p.usedGpuMemory for p in plain}, {p.pid: p.usedGpuMemory for p in mps})


def grant(tmp: Path, card: str, daemon: Daemon, limit_mib: int = LIMIT_MIB, threads: int = THREADS) -> Path:
    mps = {"sharing": SHARING_MPS, "mps_pipe": str(daemon.pipe), "region_path": str(tmp / "region")}
    write_grant(tmp / "grant", Grant((card,), (limit_mib * MIB,), (threads,), **mps))  # type: ignore[arg-type]
    return tmp / "grant"


def hooked(lib: Path, grant_file: Path, **extra: str) -> dict[str, str]:
    hook = {"LD_PRELOAD": str(lib), "VGPU_GRANT_FILE": str(grant_file), "VGPU_LOG_LEVEL": "warn"}
    return plain_env() | hook | extra


class Child:
    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.name = " ".join(argv[:2])
        self.proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)

    def line(self, timeout: float = 120) -> str:
        assert self.proc.stdout is not None
        if not self.sel.select(timeout):
            self.proc.kill()
            raise AssertionError(f"{self.name}: nothing within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"{self.name} exited {self.proc.returncode}: {err[-3000:]}")
        return line

    def read(self) -> dict[str, Any]:
        report: dict[str, Any] = json.loads(self.line())
        return report

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def finish(self) -> int:
        try:
            return self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=30)


def tenant(mode: str, env: dict[str, str]) -> Child:
    return Child([sys.executable, "-c", SCRIPT, mode], env)


@pytest.mark.parametrize("mode", ["as-is", "unset", "raise"])
def test_pytorch_is_an_mps_client_held_to_its_grant_whatever_it_sets(
    mps: Daemon, lib: Path, tmp_path: Path, card: str, nvml: Any, mode: str
) -> None:
    child = tenant(mode, hooked(lib, grant(tmp_path, card, mps)))
    try:
        start = child.read()
        plain, clients = lists(nvml, card)
        child.go()
        oom = child.read()
        _, clients_full = lists(nvml, card)
        with Region(tmp_path / "region") as r:
            hook_used = r.snapshot().devices[0].used_bytes
        child.go()
        alive = child.read()
    finally:
        rc = child.finish()
    pid = child.proc.pid
    driver = clients_full.get(pid)
    record(
        f"mps-torch-{mode}",
        env=start["env"],
        error=oom["error"],
        held_mib=oom["held"] // MIB,
        hook_mib=hook_used // MIB,
        driver_mib=None if driver is None else driver // MIB,
        server=mps.ask("get_server_list"),
        mps_pids=sorted(clients),
        plain_pids=sorted(plain),
    )
    assert start["env"] == dict(zip(MPS_VARS, (str(mps.pipe), str(THREADS), f"0={LIMIT_MIB}M"), strict=True))
    assert start["total"] == LIMIT_MIB * MIB
    assert pid in clients and pid in plain, f"NVML's MPS list {clients}, plain {plain}: pid {pid}"
    assert oom["error"] == "OutOfMemoryError" and oom["held"] > 0
    assert hook_used <= LIMIT_MIB * MIB
    assert driver is None or driver <= LIMIT_MIB * MIB, f"the driver says the client holds {driver} bytes"
    assert alive["stage"] == "alive" and alive["value"] > 0 and rc == 0


def test_two_mps_clients_of_one_grant_cannot_hold_3_gib_each(
    mps: Daemon, lib: Path, tmp_path: Path, card: str
) -> None:
    env = hooked(lib, grant(tmp_path, card, mps))
    first = tenant("hold3g", env)
    try:
        first.read()
        first.go()
        a = first.read()
        second = tenant("hold3g", env)
        try:
            second.read()
            second.go()
            b = second.read()
            with Region(tmp_path / "region") as r:
                together = r.snapshot().devices[0].used_bytes
        finally:
            second.go()
            second.finish()
    finally:
        first.go()
        first.finish()
    record("mps-two-processes", first=a, second=b, together_mib=together // MIB)
    # the second's context (or its 3 GiB) does not fit beside the first's: refused before the driver
    assert a["ok"] is True and b["ok"] is False and b["error"] in ("context", "OutOfMemoryError"), (a, b)
    assert together <= LIMIT_MIB * MIB


def fields(line: str) -> dict[str, str]:
    return dict(p.split("=", 1) for p in line.split() if "=" in p)


def bypass(nvml: Any, card: str, lib: Path, grant_file: Path, unset: str) -> dict[str, Any]:
    """t_bypass under the hook: 200 MiB, then (1 s later) 3000 MiB, past the hook; NVML's lists
    between the two (a client the driver refuses exits after the second)."""
    child = Child(
        [str(BUILD / "tests" / "t_bypass"), "200", "3000"], hooked(lib, grant_file, T_BYPASS_UNSET_MPS=unset)
    )
    try:
        below = fields(child.line())
        plain, clients = lists(nvml, card)
        crossed = fields(child.line())
        plain_after, _ = lists(nvml, card)
    finally:
        child.proc.kill()
        child.finish()
    found = {"below": below, "crossed": crossed, "plain": plain, "mps": clients, "after": plain_after}
    return found | {"pid": child.proc.pid}


def test_past_the_hook_the_driver_holds_an_mps_client_to_its_pinned_limit(
    mps: Daemon, lib: Path, tmp_path: Path, card: str, nvml: Any
) -> None:
    got = bypass(nvml, card, lib, grant(tmp_path, card, mps, limit_mib=1000), "0")
    record("mps-bypass-pinned", **{k: v for k, v in got.items() if k != "after"})
    assert got["below"]["rc"] == "0", got
    assert got["crossed"]["rc"] != "0", (
        f"the driver let an MPS client pinned at 1000 MiB take 3000 MiB: {got}"
    )
    assert got["pid"] in got["mps"] and got["pid"] in got["plain"], got


def test_a_process_past_the_hook_that_drops_the_pipe_is_a_plain_process_to_nvml(
    mps: Daemon, lib: Path, tmp_path: Path, card: str, nvml: Any
) -> None:
    got = bypass(nvml, card, lib, grant(tmp_path, card, mps, limit_mib=1000), "1")
    record("mps-bypass-plain", **got)
    assert got["below"]["rc"] == "0" and got["crossed"]["rc"] == "0", got  # no MPS limit reached it
    assert got["pid"] in got["plain"] and got["pid"] not in got["mps"], got
    assert (got["after"].get(got["pid"]) or 0) >= 3000 * MIB, got


def test_the_nodes_second_line_kills_a_process_that_dropped_the_pipe_past_its_grant(
    mps: Daemon, lib: Path, tmp_path: Path, card: str
) -> None:
    """test_enforce_gpu.py's row on an MPS card: the bypasser is a plain process there, seen by the
    node's enforcer through NVML's compute list and killed within 1 s of crossing its grant."""
    why = "the node's enforcer needs the product's dependencies: stage bundle part a (tools/gpu-bundle.sh)"
    enforce = pytest.importorskip("vgpu.monitor.enforce", reason=why)
    from tests.support import wait_for
    from tests.support.cgroups import granted_container, kubepods_cgroups, reap, reaped_at
    from vgpu.monitor.hostview import HostView
    from vgpu.node.nvml import NvmlDiscovery
    from vgpu.node.paths import HostPaths

    paths = HostPaths(tmp_path / "root")
    paths.grants_dir.mkdir(parents=True)
    discovery = NvmlDiscovery()
    try:
        with kubepods_cgroups(tmp_path, "vgpu-gpu-mps") as cgroups:
            _, cgroup = granted_container(paths, cgroups, "cuda", card, 1000 * MIB)
            enforcer = enforce.Enforcer(
                "n1", HostView("n1", paths, discovery, lambda: [card]), "kill", 256 * MIB, interval_s=0.1
            )
            enforcer.start()
            script = f'echo $$ > {cgroup}/cgroup.procs && exec "$0" "$@"'
            greedy = Child(
                ["/bin/sh", "-c", script, str(BUILD / "tests" / "t_bypass"), "200", "3000"],
                hooked(lib, grant(tmp_path, card, mps, limit_mib=1000), T_BYPASS_UNSET_MPS="1"),
            )
            try:
                assert "rc=0" in greedy.line(), "the bypasser could not take its first 200 MiB"
                died = reaped_at(greedy.proc)
                crossed = fields(greedy.line())
                assert crossed["rc"] == "0", crossed
                wait_for(lambda: died, "the bypassing process to be killed", 5, every=0.005)
                seconds = (died[0] - int(crossed["mono_ns"])) / 1e9
                acted = enforcer.stats.actions or {}
            finally:
                enforcer.stop()
                reap([greedy.proc], timeout=30)
    finally:
        discovery.close()
    record("mps-second-line", crossing_to_kill_ms=seconds * 1000, actions=str(acted))
    assert greedy.proc.returncode == -9 and seconds < 1.0, (greedy.proc.returncode, seconds)
    assert acted == {("kill", "", "", "cuda"): 1}, acted
