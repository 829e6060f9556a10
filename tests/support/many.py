"""Many processes of one container starting CUDA at the same moment (issue 23, item 5).

``start_together`` starts N copies of ``native/hook/build/b_many``, waits until every one blocks
at a barrier (a pipe each reads until end of file), releases them all at once by closing the
pipe, and collects each one's report of its start-up (cuInit, the devices enumerated,
cuDeviceTotalMem, the primary context, one allocation, cuMemGetInfo). While all of them hold
what they got, ``while_held`` looks (the region, the driver's figures); then they are told to
finish, and their exit statuses are collected. ``Container`` lays out what Allocate gives a
container: a grant naming the region file, the hook preloaded.

Shared by ``bench/bench_many.py`` (timing), ``tests/integration/test_hook_many.py`` (the stub
driver) and ``tests/gpu/test_many_gpu.py`` (an H200). ``bounded_start`` is the GPU test's whole
run (a bare start that measures how many contexts the driver makes at once, then a grant of two
thirds of that), which the stub driver runs too under a context bound of its own. Only the
standard library and ``vgpu.hookabi``.
"""

from __future__ import annotations

import os
import select
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

import yaml

from vgpu.hookabi.grant import Grant, write_grant
from vgpu.hookabi.region import Region, Snapshot
from vgpu.node.fake_nvml import FakeDiscovery

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "native" / "hook" / "build"
PROGRAM = BUILD / "b_many"
MIB = 1 << 20
STUB_CARD = "GPU-57ab0000-0000-4000-8000-000000000000"  # the stub driver's device 0, as held_on_stub names it
CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
# What Allocate's environment may carry in from the caller's: none of it may leak into a run.
_DROP = ("CUDA_DEVICE_", "CUDA_SM_", "CUDA_TASK_", "CUDA_OVERSUBSCRIBE", "LD_PRELOAD", "VGPU_", "STUB_CUDA_")

T = TypeVar("T")


@dataclass(frozen=True)
class Start:
    """One process's report (b_many's line)."""

    pid: int
    wake_ns: int
    done_ns: int
    init_ns: int
    query_ns: int
    ctx_ns: int
    alloc_ns: int
    devices: int
    ctx_rc: int  # -1: no context asked for
    alloc_rc: int  # -1: no allocation made
    total: int  # cuDeviceTotalMem
    info_free: int
    info_total: int
    failed: str = ""  # STEP:RC of a start-up step that failed

    @classmethod
    def parse(cls, line: str) -> Start:
        values = dict(part.split("=", 1) for part in line.split())
        failed = values.pop("failed", "")
        return cls(**{k: int(v) for k, v in values.items()}, failed=failed)


@dataclass
class Round(Generic[T]):
    """What one start of N processes gave."""

    release_ns: int
    starts: list[Start]
    returncodes: list[int]
    seen: T | None  # what while_held returned
    errors: str  # the processes' stderr, all together

    def startup_s(self) -> list[float]:
        """Each process's start-up: from the common release to its report."""
        return sorted((s.done_ns - self.release_ns) / 1e9 for s in self.starts)

    def stats(self) -> dict[str, float]:
        return summary(self.startup_s())

    @property
    def contexts(self) -> int:
        return sum(1 for s in self.starts if s.ctx_rc == CUDA_SUCCESS)

    @property
    def refused(self) -> int:
        return sum(1 for s in self.starts if s.ctx_rc == CUDA_ERROR_OUT_OF_MEMORY)


def summary(values: Sequence[float]) -> dict[str, float]:
    """p50, p99 and max of values (seconds)."""
    ordered = sorted(values)
    if not ordered:
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    p99 = ordered[min(len(ordered) - 1, max(0, -(-len(ordered) * 99 // 100) - 1))]
    return {"p50": statistics.median(ordered), "p99": p99, "max": ordered[-1]}


def base_env(stub: bool, stub_mib: int = 192 * 1024) -> dict[str, str]:
    """The caller's environment without anything that would change the hook or the driver;
    over the stub driver, its libraries first and a card of stub_mib."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(_DROP)}
    if stub:
        out["LD_LIBRARY_PATH"] = str(BUILD / "stub")
        out["STUB_CUDA_MEMORY_MIB"] = str(stub_mib)
    return out


@dataclass
class Container:
    """A container as Allocate lays it out: its grant (naming the region file) and the hook.

    The grant is named with VGPU_GRANT_FILE, the hand-run equivalent of the read-only mount at
    /etc/vgpu/limits (tests/integration/test_hook_grant.py runs the real mount); LD_PRELOAD
    stands for /etc/ld.so.preload."""

    folder: Path
    limit_bytes: int
    context_reserve: int = 640 * MIB
    uuid: str = "GPU-many-0"
    grant: Path = field(init=False)
    region: Path = field(init=False)

    def __post_init__(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.grant = self.folder / "vgpu.limits"
        self.region = self.folder / "vgpu.region"
        self.reset()

    def reset(self) -> None:
        """A fresh container: a new grant, no region file yet (its first process makes it)."""
        self.region.unlink(missing_ok=True)
        write_grant(
            self.grant,
            Grant(
                (self.uuid,),
                (self.limit_bytes,),
                region_path=str(self.region),
                context_reserve=self.context_reserve,
            ),
        )

    def env(self, base: dict[str, str], **extra: str) -> dict[str, str]:
        return base | {"LD_PRELOAD": str(BUILD / "libvgpu.so"), "VGPU_GRANT_FILE": str(self.grant)} | extra

    def snapshot(self) -> Snapshot:
        with Region(self.region) as r:
            return r.snapshot()


def _read_bytes(
    fd: int, want: int, deadline: float, procs: Sequence[subprocess.Popen[bytes]], what: str
) -> None:
    got = 0
    while got < want:
        left = deadline - time.monotonic()
        if left <= 0:
            dead = sum(1 for p in procs if p.poll() is not None)
            raise TimeoutError(f"{what}: {got} of {want} processes got there in time ({dead} had exited)")
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                dead = sum(1 for p in procs if p.poll() is not None)
                raise RuntimeError(f"{what}: {got} of {want} processes got there; the others exited ({dead})")
            got += len(chunk)


def start_together(
    count: int,
    environ: dict[str, str] | Callable[[int], dict[str, str]],
    workdir: Path,
    *,
    modes: Callable[[int], str] = lambda i: "ctx",
    alloc_bytes: int = MIB,
    while_held: Callable[[list[Start]], T] | None = None,
    timeout: float = 300,
    exit_timeout: float = 120,
) -> Round[T]:
    """Starts ``count`` b_many processes, releases them together, returns what they reported.

    ``environ`` (or ``environ(i)``) is each process's environment; ``modes(i)`` is ``ctx`` (start
    a context and allocate) or ``query`` (cuInit and the device queries only). ``timeout`` bounds
    the start (all at the barrier, all reported), ``exit_timeout`` their exits once told to finish;
    a process still there then is killed."""
    workdir.mkdir(parents=True, exist_ok=True)
    out_path, err_path = workdir / "starts.txt", workdir / "stderr.txt"
    out_path.unlink(missing_ok=True)
    err_path.unlink(missing_ok=True)
    go_r, go_w = os.pipe()
    hold_r, hold_w = os.pipe()
    ready_r, ready_w = os.pipe()
    out_fd = os.open(out_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    err_fd = os.open(err_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    procs: list[subprocess.Popen[bytes]] = []
    deadline = time.monotonic() + timeout
    seen: T | None = None
    try:
        for i in range(count):
            args = [str(PROGRAM), modes(i), str(alloc_bytes), str(go_r), str(hold_r), str(ready_w)]
            procs.append(
                subprocess.Popen(
                    args,
                    env=environ(i) if callable(environ) else environ,
                    stdin=subprocess.DEVNULL,
                    stdout=out_fd,
                    stderr=err_fd,
                    pass_fds=(go_r, hold_r, ready_w),
                )
            )
        for fd in (go_r, hold_r, ready_w, out_fd, err_fd):
            os.close(fd)
        go_r = hold_r = ready_w = out_fd = err_fd = -1
        _read_bytes(ready_r, count, deadline, procs, "waiting at the barrier")
        release_ns = time.monotonic_ns()  # CLOCK_MONOTONIC, as b_many's stamps
        os.close(go_w)
        go_w = -1
        _read_bytes(ready_r, count, deadline, procs, "reporting their start-up")
        starts = [Start.parse(line) for line in out_path.read_text().splitlines() if line.strip()]
        if while_held is not None:
            seen = while_held(starts)
    finally:
        for fd in (go_r, go_w, hold_r, ready_w, out_fd, err_fd):
            if fd >= 0:
                os.close(fd)
        os.close(hold_w)  # everyone finishes (also after a failure: nothing is left holding)
        os.close(ready_r)
        exit_deadline = time.monotonic() + exit_timeout
        for p in procs:
            try:
                p.wait(timeout=max(1.0, exit_deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return Round(release_ns, starts, [p.returncode for p in procs], seen, err_path.read_text())


# The GPU run (--gpu, tests/gpu/test_many_gpu.py) must never ask the card for more than it holds.
CONTEXT_BOUND_MIB = 600  # what a bare driver-API context takes at most: 518 MiB measured on an H200, CUDA 13
GRANT_CAP_MIB = 100 * 1024  # the grant of a GPU run stays at or under 100 GiB


def _smi(*query: str) -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", *query, "--format=csv,noheader,nounits"],
        env=base_env(stub=False),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line.strip()]


def gpu_plan(procs: int, attempts: int, fit: int, alloc_mib: int) -> dict[str, int]:
    """How many processes may ask card 0 for a context, and how many the grant fits.

    Every process that asks is bounded by what the card has free now: attempts * (600 MiB + the
    allocation) stays within 90 % of it, so even with no hook at all (the bare run) the card is
    never asked for more than it holds. The grant fits ``fit`` contexts of 640 MiB (the hook's
    charge) and their allocation, at most 100 GiB, fewer than ``attempts``: the hook refuses the
    others at context creation, before the driver is asked."""
    free_mib, total_mib = (int(v) for v in _smi("-i", "0", "--query-gpu=memory.free,memory.total")[0])
    per = CONTEXT_BOUND_MIB + alloc_mib
    attempts = min(attempts, procs, free_mib * 9 // 10 // per)
    fit = min(fit, attempts, GRANT_CAP_MIB // (640 + alloc_mib))
    if attempts < 1 or fit < 1:
        raise RuntimeError(f"card 0 has {free_mib} MiB free: too little for one context of {per} MiB")
    return {"attempts": attempts, "fit": fit, "card_free_mib": free_mib, "card_total_mib": total_mib}


def held_on_gpu(pids: set[int]) -> dict[str, int]:
    """What the driver says these processes hold on the cards (MiB), and how many it lists."""
    rows = [r for r in _smi("--query-compute-apps=pid,used_memory") if r[0].isdigit() and int(r[0]) in pids]
    return {"driver_mib": sum(int(r[1]) for r in rows if r[1].isdigit()), "driver_procs": len(rows)}


def held_on_stub(process_dir: Path, pids: set[int]) -> dict[str, int]:
    """What the stub driver says these processes hold on device 0 (MiB; its files in
    STUB_CUDA_PROCESS_DIR), read as the node reads them, through the fake NVML backend, and how
    many hold anything."""
    described = process_dir.parent / f"{process_dir.name}.gpus.yaml"
    described.write_text(
        yaml.safe_dump({"gpus": [{"uuid": STUB_CARD, "memoryMiB": 1 << 20}], "processDir": str(process_dir)})
    )
    held = [p for p in FakeDiscovery(described).processes(STUB_CARD) or [] if p.pid in pids]
    return {"driver_mib": sum(p.memory_bytes for p in held) // MIB, "driver_procs": len(held)}


@dataclass
class BoundedStart:
    """``procs`` processes started together twice: bare, where the first ``attempts`` ask the
    driver for a context and it makes what it can at once (``bare.contexts``, its bound), then
    under a grant that fits two thirds of that bound (``fit``), where the hook must refuse the
    rest at their context, before the driver is asked. ``driver`` says what the driver lists
    while they hold."""

    plan: dict[str, int]  # attempts, and fit: the contexts the grant fits
    each: int  # the hook's charge for one process with a context and its allocation
    box: Container
    bare: Round[dict[str, object]]
    hooked: Round[dict[str, object]]
    after: Snapshot

    @property
    def fit(self) -> int:
        return self.plan["fit"]

    @property
    def region(self) -> Snapshot:
        """The region as the hooked run's processes held."""
        region = self.hooked.seen["region"] if self.hooked.seen else None
        assert isinstance(region, Snapshot)
        return region

    def figures(self) -> dict[str, object]:
        """The run as one JSON line's fields (tests/gpu/gpu_figures.py)."""
        region = self.region
        assert self.bare.seen is not None and self.hooked.seen is not None
        return {
            "procs": len(self.bare.starts),
            **self.plan,
            "grant_mib": self.box.limit_bytes // MIB,
            "bare": {**self.bare.stats(), "contexts": self.bare.contexts, **self.bare.seen},
            "hooked": {
                **self.hooked.stats(),
                "contexts": self.hooked.contexts,
                "refused": self.hooked.refused,
                "charged_mib": region.devices[0].used_bytes // MIB,
                "slots": len(region.processes),
                **{k: v for k, v in self.hooked.seen.items() if k != "region"},
            },
            "after_used": self.after.devices[0].used_bytes,
            "after_slots": len(self.after.processes),
            "outcomes": {"bare": outcomes(self.bare), "hooked": outcomes(self.hooked)},
        }

    def check(self) -> None:
        """Every process started in both runs; the driver made or cleanly refused every context
        bare; under the hook exactly ``fit`` contexts were made, the others refused before the
        driver, and what they held together (the hook's charges, the driver's figure) stayed
        within the grant; the region was empty afterwards."""
        attempts, fit, box, hooked = self.plan["attempts"], self.fit, self.box, self.hooked
        for run in (self.bare, hooked):
            assert len(run.starts) == len(run.returncodes), run.errors[-3000:]
            assert [s.failed for s in run.starts if s.failed] == [], run.errors[-3000:]
            assert run.returncodes == [0] * len(run.returncodes), run.errors[-3000:]
            assert all(s.devices >= 1 and s.total > 0 for s in run.starts)
            assert sum(1 for s in run.starts if s.ctx_rc != -1) == attempts
        assert self.bare.contexts + self.bare.refused == attempts and self.bare.contexts >= 3
        assert (hooked.contexts, hooked.refused) == (fit, attempts - fit), outcomes(hooked)
        refused = [s for s in hooked.starts if s.ctx_rc == CUDA_ERROR_OUT_OF_MEMORY]
        assert all(s.alloc_rc == -1 for s in refused)
        assert all(s.alloc_rc == CUDA_SUCCESS for s in hooked.starts if s.ctx_rc == CUDA_SUCCESS)
        assert {s.total for s in hooked.starts} == {box.limit_bytes}  # each sees the grant as the card
        region = self.region
        assert hooked.seen is not None
        assert region.devices[0].used_bytes == fit * self.each <= box.limit_bytes
        # one region, a slot for each process that charged (the query-only ones charge nothing)
        assert len(region.processes) == attempts
        assert hooked.seen["driver_procs"] == fit  # the refused never reached the driver
        driver_mib = hooked.seen["driver_mib"]
        assert isinstance(driver_mib, int) and driver_mib * MIB <= box.limit_bytes
        assert (self.after.devices[0].used_bytes, self.after.processes) == (0, ())


def outcomes(run: Round[T]) -> dict[str, object]:
    """What the processes' steps returned and took: the context's return codes counted, failed
    steps counted, the seconds of cuInit and of the context (p50/p99/max), and the last of stderr."""
    return {
        "ctx_rc": dict(Counter(str(s.ctx_rc) for s in run.starts)),
        "failed": dict(Counter(s.failed for s in run.starts if s.failed)),
        "init_s": summary([s.init_ns / 1e9 for s in run.starts]),
        "ctx_s": summary([s.ctx_ns / 1e9 for s in run.starts if s.ctx_rc != -1]),
        "returncodes": sorted(set(run.returncodes)),
        "stderr_tail": run.errors[-600:],
    }


def bounded_start(
    workdir: Path,
    base: dict[str, str],
    plan: dict[str, int],
    driver: Callable[[list[Start]], dict[str, object]],
    *,
    procs: int,
    alloc_mib: int,
    timeout: float,
) -> BoundedStart:
    """The bare run, then the grant of two thirds of the contexts it made at once (at most
    ``plan["fit"]``); ``plan["fit"]`` and ``plan["driver_bound"]`` are set to what was used."""
    attempts = plan["attempts"]
    each = (640 + alloc_mib) * MIB

    def modes(i: int) -> str:
        return "ctx" if i < attempts else "query"

    bare = start_together(
        procs,
        base,
        workdir / "bare",
        modes=modes,
        alloc_bytes=alloc_mib * MIB,
        while_held=driver,
        timeout=timeout,
    )
    # the grant fits two thirds of what the driver made, so what the hook refuses is its own doing
    fit = max(1, min(plan["fit"], bare.contexts * 2 // 3))
    plan["fit"], plan["driver_bound"] = fit, bare.contexts
    box = Container(workdir / "container", limit_bytes=fit * each)

    def both(starts: list[Start]) -> dict[str, object]:
        return driver(starts) | {"region": box.snapshot()}

    hooked = start_together(
        procs,
        box.env(base),
        workdir / "hooked",
        modes=modes,
        alloc_bytes=alloc_mib * MIB,
        while_held=both,
        timeout=timeout,
    )
    return BoundedStart(plan, each, box, bare, hooked, box.snapshot())
