"""Two inference tenants on one card, in every sharing mode: each tenant's throughput as a share of
the same workload alone on the card (issue 39).

    python3 bench/bench_mps.py [--modes driver,caps,mps,ours-mps] [--seconds 5] [--inflight 1,8,32]
                               [--hook native/hook/build/libvgpu.so] [--json OUT]

Needs a GPU (the card nvidia-smi calls 0), PyTorch and, for the MPS modes, nvidia-cuda-mps-control
on PATH and root (or the card's owner). Each tenant is a process of bench/mps_worker.py: a
transformer decoder with random fp16 weights (workloads()): prefill (busy kernels), decode
(launch-bound), and a serving form at 1, 8 and 32 requests in flight (tokens/s). Modes:

  driver    plain time-slicing by the driver, no hook;
  caps      our hook under a grant (VGPU_GRANT_FILE) of --cores percent of the SMs (time-slice
            caps) and --limit-mib of memory;
  mps       an MPS control daemon the bench starts (its pipe and log folders in a temporary
            folder), clients with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=--cores and
            CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=--limit-mibM in their environment;
  ours-mps  the same daemon, clients under our hook with an MPS grant (sharing 1, the pipe
            folder, --cores as the thread percentage, --limit-mib): no CUDA_MPS_* variable is
            set, the hook sets them from the grant.
Then the lifting rows (LIFTS): tenant A of a pair tries to lift its limits with what a tenant
controls (its environment; VGPU_GRANT_FILE and LD_PRELOAD stand for the read-only grant mount and
/etc/ld.so.preload of a container, so it keeps them), tenant B stays honest.

A run: both tenants build and warm up their workload, say ready, and start together at one
CLOCK_MONOTONIC instant the bench hands both (the barrier); each measures the same window, from
--warmup seconds after that instant for --seconds, by CUDA events. After a mode's workloads each
tenant asks for --limit-mib + 1024 MiB in chunks (the memory row: what it got). The daemon is
stopped (`echo quit | nvidia-cuda-mps-control` with its environment) in a finally, and every
process the bench started is ended. Prints a markdown table; --json writes one JSON line a figure.
bench/README.md says how to run and read it; mps_procs.py runs the daemon and the tenants,
mps_table.py makes the tables; tests/unit/test_bench_mps.py runs it all over stand-ins.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # vgpu.hookabi, on the GPU machine where the package is not installed
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mps_procs import BenchError, Worker, mps_clients, start_daemon, stop_daemon  # noqa: E402
from mps_table import render  # noqa: E402

from vgpu.hookabi.grant import Grant, write_grant  # noqa: E402
from vgpu.hookabi.layout import SHARING_MPS  # noqa: E402

HOOK_DIR = ROOT / "native" / "hook"
WORKER = Path(__file__).resolve().parent / "mps_worker.py"
MODES = ("driver", "caps", "mps", "ours-mps")
HOOKED = ("caps", "ours-mps")
DAEMON = ("mps", "ours-mps")
MPS_VARS = (
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
)
MODEL: dict[str, Any] = {"d": 1024, "heads": 16, "vocab": 32000}
HELLO_S, READY_S = 240.0, 180.0  # PyTorch's import and CUDA's start; a workload's build and warm-up


def workloads(inflight: list[int], names: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """(label, the worker's spec) in the table's order; a serving row warms up a whole request's cycle."""
    out: list[tuple[str, dict[str, Any]]] = []
    if "prefill" in names:
        out.append(
            (
                "prefill",
                MODEL | dict(kind="prefill", layers=12, batch=8, tokens=256, unit="steps", warm_steps=5),
            )
        )
    if "decode" in names:
        out.append(
            (
                "decode",
                MODEL | dict(kind="decode", layers=24, batch=4, context=256, unit="steps", warm_steps=30),
            )
        )
    if "serve" in names:
        serve = dict(kind="serve", layers=24, prompt=128, generate=128, unit="tokens", warm_steps=128)
        out += [(f"serve-{n}", MODEL | serve | {"batch": n}) for n in inflight]
    return out


DESCRIBE = {
    "prefill": "prefill (12 layers, d 1024, 8 x 256 tokens), steps/s",
    "decode": "decode (24 layers, 4 x 1 token, KV 256-511), steps/s",
    "serve": "serve, {n} in flight (24 layers, prompt 128, 128 out), tokens/s",
}


@dataclass(frozen=True)
class Lift:
    mode: str
    tries: str
    sets: dict[str, str] = field(default_factory=dict)
    unsets: tuple[str, ...] = ()


LIFTS = {
    "caps": Lift(
        "caps",
        "CUDA_DEVICE_SM_LIMIT=100, CUDA_DEVICE_MEMORY_LIMIT=64g",
        {"CUDA_DEVICE_SM_LIMIT": "100", "CUDA_DEVICE_MEMORY_LIMIT": "64g"},
    ),
    "mps-threads": Lift(
        "mps",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100, pinned limit unset",
        {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"},
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",),
    ),
    "mps-otherdev": Lift(
        "mps",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=1=6144M (a device it cannot see)",
        {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "1=6144M"},
    ),
    "mps-leave": Lift("mps", "every CUDA_MPS_* unset (leaves MPS)", {}, MPS_VARS),
    "ours-mps": Lift(
        "ours-mps",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=1=65536M, "
        "CUDA_MPS_PIPE_DIRECTORY=a folder with no daemon, CUDA_DEVICE_SM_LIMIT=100, "
        "CUDA_DEVICE_MEMORY_LIMIT=64g",
        {
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "1=65536M",
            "CUDA_MPS_PIPE_DIRECTORY": "{nowhere}",
            "CUDA_DEVICE_SM_LIMIT": "100",
            "CUDA_DEVICE_MEMORY_LIMIT": "64g",
        },
    ),
}


@dataclass
class Ctx:
    tmp: Path
    uuid: str
    hook: Path
    cores: int
    limit_mib: int
    control: str
    base: dict[str, str]


def base_env(environ: dict[str, str]) -> dict[str, str]:
    """The caller's environment less every variable that sets a limit, the hook or MPS."""
    drop = ("CUDA_", "LD_PRELOAD", "VGPU_", "STUB_CUDA_")
    env = {k: v for k, v in environ.items() if not k.startswith(drop)}
    return env | {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "PYTHONUNBUFFERED": "1"}  # CUDA's 0 is nvidia-smi's 0


def tenant_env(
    ctx: Ctx, mode: str, folder: Path, pipe: Path | None, lift: Lift | None = None
) -> dict[str, str]:
    """One tenant's environment; under caps and ours-mps its grant is written in `folder` first."""
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(ctx.base)
    if mode in HOOKED:
        region = str(folder / "vgpu.region")
        limits = (ctx.limit_mib << 20,)
        if mode == "ours-mps":
            assert pipe is not None
            grant = Grant(
                (ctx.uuid,),
                limits,
                sm_limits=(ctx.cores,),
                region_path=region,
                sharing=SHARING_MPS,
                mps_pipe=str(pipe),
            )
        else:
            grant = Grant((ctx.uuid,), limits, sm_limits=(ctx.cores,), region_path=region)
        write_grant(folder / "grant.limits", grant)
        env |= {
            "LD_PRELOAD": str(ctx.hook),
            "VGPU_GRANT_FILE": str(folder / "grant.limits"),
            "VGPU_LOG_LEVEL": "warn",
        }
    if mode == "mps":
        assert pipe is not None
        env |= {
            "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(ctx.cores),
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={ctx.limit_mib}M",
        }
    if lift is not None:
        nowhere = folder / "no-daemon"
        nowhere.mkdir(exist_ok=True)
        env |= {k: v.format(nowhere=nowhere) for k, v in lift.sets.items()}
        for name in lift.unsets:
            env.pop(name, None)
    return env


def daemon_env(ctx: Ctx, root: Path) -> dict[str, str]:
    return ctx.base | {
        "CUDA_VISIBLE_DEVICES": ctx.uuid,
        "CUDA_MPS_PIPE_DIRECTORY": str(root / "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(root / "log"),
    }


def measure(workers: list[Worker], spec: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One run: every tenant ready, then one start instant for all (the barrier), then their rates."""
    for w in workers:
        w.send(
            {
                "cmd": "run",
                "workload": spec,
                "warmup": args.warmup,
                "seconds": args.seconds,
                "tail": args.tail,
            }
        )
    for w in workers:
        w.receive(READY_S)
    t0 = time.monotonic_ns() + 50_000_000
    for w in workers:
        w.send({"go": t0})
    return [w.receive(args.warmup + args.seconds + args.tail + 120) for w in workers]


def run_group(
    ctx: Ctx,
    args: argparse.Namespace,
    label: str,
    mode: str,
    lift: str | None,
    specs: list[tuple[str, dict[str, Any]]],
    tenants: str,
    emit: Any,
) -> None:
    """One mode (or one lift) with its own tenants and daemon: every workload, then the memory probe."""
    root = ctx.tmp / label
    daemon, workers = None, []
    tag = {"mode": mode, "lift": lift}
    try:
        if mode in DAEMON:
            daemon = start_daemon(ctx.control, daemon_env(ctx, root))
        for name in tenants:
            env = tenant_env(
                ctx,
                mode,
                root / name,
                daemon.pipe if daemon else None,
                LIFTS[lift] if lift and name == "A" else None,
            )
            workers.append(Worker(name, [sys.executable, str(args.worker)], env, root / f"{name}.log"))
        hellos = [w.receive(HELLO_S) for w in workers]
        clients = mps_clients(daemon) if daemon else set()
        for w, hello in zip(workers, hellos, strict=True):
            emit(
                tag
                | {
                    "kind": "tenant",
                    "tenant": w.name,
                    "pid": hello["pid"],
                    "device": hello.get("device"),
                    "torch": hello.get("torch"),
                    "mps_env": hello.get("mps_env"),
                    "mps_client": (hello["pid"] in clients) if daemon else None,
                }
            )
        for wl, spec in specs:
            try:
                results = measure(workers, spec, args)
            except BenchError as err:
                emit(tag | {"kind": "error", "workload": wl, "error": str(err)})
                return
            for w, r in zip(workers, results, strict=True):
                emit(tag | {"kind": "run", "workload": wl, "tenant": w.name, "unit": spec["unit"]} | r)
        ask = ctx.limit_mib + 1024
        for w in workers:
            w.send({"cmd": "probe", "ask_mib": ask})
            emit(
                tag
                | {"kind": "probe", "tenant": w.name, "asked_mib": ask, "got_mib": w.receive(120)["got_mib"]}
            )
    except BenchError as err:
        emit(tag | {"kind": "error", "workload": None, "error": str(err)})
    finally:  # stopped from outside (SIGTERM, Ctrl-C): a tenant mid-run is not waited for
        grace = 15.0 if sys.exc_info()[0] is None else 1.0
        for w in workers:
            w.close(grace)
        if daemon is not None:
            stop_daemon(daemon)


def card() -> tuple[str, str, int]:
    """The uuid, "name (driver x)" and MiB of nvidia-smi's card 0."""
    query = "--query-gpu=uuid,name,driver_version,memory.total"
    try:
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError) as err:
        raise SystemExit(f"nvidia-smi did not run ({err}): this benchmark needs a GPU") from err
    fields = [f.strip() for f in out.stdout.strip().split(",")]
    if out.returncode != 0 or len(fields) != 4:
        raise SystemExit(f"nvidia-smi finds no GPU ({out.stderr.strip()}): this benchmark needs a GPU")
    return fields[0], f"{fields[1]} (driver {fields[2]})", int(float(fields[3]))


def csv(text: str, allowed: tuple[str, ...], option: str) -> list[str]:
    items = [i.strip() for i in text.split(",") if i.strip() and i.strip() != "none"]
    bad = [i for i in items if i not in allowed]
    if bad:
        raise SystemExit(
            f"{option}: {', '.join(bad)} unknown; choose from {', '.join(allowed)} (comma-separated)"
        )
    return items


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    p.add_argument(
        "--workloads", default="prefill,decode,serve", help="comma-separated: prefill, decode, serve"
    )
    p.add_argument("--inflight", default="1,8,32", help="requests in flight of the serving rows")
    p.add_argument(
        "--lifts", default=",".join(LIFTS), help="lifting rows (none: no lifting): " + ", ".join(LIFTS)
    )
    p.add_argument("--lift-workload", default="prefill", choices=["prefill", "decode"])
    p.add_argument("--seconds", type=float, default=5.0, help="the measured window of each run")
    p.add_argument("--warmup", type=float, default=1.5, help="seconds both tenants run before the window")
    p.add_argument("--tail", type=float, default=0.5, help="seconds each keeps running after the window")
    p.add_argument("--cores", type=int, default=50, help="the SM share of caps, mps and ours-mps (percent)")
    p.add_argument("--limit-mib", type=int, default=6144, help="each tenant's memory limit (MiB)")
    p.add_argument(
        "--hook", type=Path, default=HOOK_DIR / "build" / "libvgpu.so", help="the libvgpu.so to preload"
    )
    p.add_argument("--mps-control", default="nvidia-cuda-mps-control", help="the MPS control binary")
    p.add_argument("--json", type=Path, help="write one JSON line a figure here")
    p.add_argument("--worker", type=Path, default=WORKER, help=argparse.SUPPRESS)  # the tests' stand-in
    args = p.parse_args(argv)
    args.modes = csv(args.modes, MODES, "--modes")
    args.workloads = csv(args.workloads, ("prefill", "decode", "serve"), "--workloads")
    args.lifts = [lift for lift in csv(args.lifts, tuple(LIFTS), "--lifts") if LIFTS[lift].mode in args.modes]
    try:
        args.inflight = [int(n) for n in args.inflight.split(",") if n.strip()]
    except ValueError:
        raise SystemExit(f"--inflight: {args.inflight!r}: whole numbers, comma-separated (1,8,32)") from None
    if any(not 1 <= n <= 64 for n in args.inflight):
        raise SystemExit(f"--inflight: {args.inflight}: each from 1 to 64 (the KV cache grows with it)")
    if not 1 <= args.cores <= 100:
        raise SystemExit(f"--cores: {args.cores}: a percent from 1 to 100")
    if args.seconds <= 0 or args.warmup < 0 or args.tail < 0:
        raise SystemExit("--seconds must be above 0, --warmup and --tail 0 or more")
    return args


def stop(*_: object) -> None:
    """SIGTERM: unwind through every finally (tenants ended, daemon stopped), which a second one
    must not cut short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(143)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, stop)  # `timeout` too runs the finally blocks
    uuid, where, total_mib = card()
    if 2 * (args.limit_mib + 1024) + 8192 > total_mib:
        raise SystemExit(
            f"--limit-mib {args.limit_mib}: two tenants and their probes need more than the "
            f"card's {total_mib} MiB; lower it"
        )
    hooked = any(m in HOOKED for m in args.modes)
    if hooked and args.hook == HOOK_DIR / "build" / "libvgpu.so":
        subprocess.run(["make", "-s", "-C", str(HOOK_DIR)], check=True)
    if hooked and not args.hook.is_file():
        raise SystemExit(f"--hook: {args.hook} does not exist (make -C native/hook)")
    specs = workloads(args.inflight, args.workloads)
    groups: list[tuple[str, str, str | None, list[tuple[str, dict[str, Any]]], str]] = [
        ("alone", "driver", None, specs, "A")
    ]
    groups += [(m, m, None, specs, "AB") for m in args.modes]
    lifted = [s for s in specs if s[0] == args.lift_workload]
    groups += [(f"lift-{lift}", LIFTS[lift].mode, lift, lifted, "AB") for lift in args.lifts if lifted]
    runs = sum(len(g[3]) for g in groups)
    guess = runs * (args.warmup + args.seconds + args.tail + 3) + 10 * len(groups)
    print(f"bench_mps: {len(groups)} groups of processes, {runs} runs, about {guess:.0f} s", file=sys.stderr)
    records: list[dict[str, Any]] = []
    out = open(args.json, "w") if args.json else None  # noqa: SIM115
    alone: dict[str, float] = {}

    def emit(record: dict[str, Any]) -> None:
        if record["kind"] == "run":
            base = alone.get(record["workload"])
            record["share"] = record["rate"] / base if base else None
        records.append(record)
        print(f"bench_mps: {json.dumps(record)[:300]}", file=sys.stderr)
        if out is not None:
            out.write(json.dumps(record) + "\n")
            out.flush()

    mps_default = Path("/tmp/nvidia-mps/control").exists()
    header = {
        "kind": "header",
        "device": where,
        "uuid": uuid,
        "hook": str(args.hook),
        "foreign_mps_daemon": mps_default,
    }
    header |= {k: getattr(args, k) for k in ("seconds", "warmup", "cores", "limit_mib")}
    try:
        with tempfile.TemporaryDirectory(prefix="vgpu-bench-mps-") as tmp:
            ctx = Ctx(
                Path(tmp),
                uuid,
                args.hook.resolve(),
                args.cores,
                args.limit_mib,
                args.mps_control,
                base_env(dict(os.environ)),
            )
            emit(header)
            for label, mode, lift, group_specs, tenants in groups:
                run_group(
                    ctx, args, label, "alone" if label == "alone" else mode, lift, group_specs, tenants, emit
                )
                if label == "alone":
                    alone.update({r["workload"]: r["rate"] for r in records if r["kind"] == "run"})
    finally:  # stopped early too (SIGTERM, Ctrl-C): the table of what was measured
        if out is not None:
            out.close()
        tries = {name: lift.tries for name, lift in LIFTS.items()}
        print(render(records, [label for label, _ in specs], args.modes, DESCRIBE, tries), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
