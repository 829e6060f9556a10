"""`vgpu limits`: show or change a running container's limits: its grant and its region file.

    vgpu limits show --container-dir /var/lib/vgpu/containers/<pod-uid>_<container> [--json]
    vgpu limits set  --container-dir DIR --device 0 [--memory MIB] [--cores PCT] [--budget MIB]

The limits live in the container's grant (``/var/lib/vgpu/grants/<folder>.limits``, written by the
device plugin, read-only inside the container); the region file ``vgpu.region`` inside the
container's folder holds usage and a copy of the limits. Naming the region file itself
(``vgpu limits set REGION ...``, the older form) works too, as does ``--sm`` for ``--cores``.
Sizes: a plain number is MiB (``--memory 4096``); with a suffix it is that unit (``512k``,
``4096m``, ``4g``; ``b`` for bytes). 0 lifts the limit (``--budget 0``: spill only past the
card's free memory).

A new limit holds from the next allocation (memory, budget) or launch (cores) of every process
of the container: live resize. Memory already taken is never taken back, so a limit below
current usage refuses new allocations until usage falls under it; the command says so.
Bad input changes nothing and exits 2 with the flag at fault and the fix.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from vgpu.hookabi import resize
from vgpu.hookabi.grant import as_granted, grant_beside, read_grant
from vgpu.hookabi.layout import FLAG_ALONE, FLAG_GUARD, FLAG_YIELD
from vgpu.hookabi.region import MAX_BYTES, Region, RegionError, Snapshot
from vgpu.hookabi.resize import LimitError, apply_limits
from vgpu.node.paths import REGION_FILE_NAME

_UNITS = {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
# the flag of each value apply_limits names in its errors
FLAGS = {
    resize.DEVICE: "--device",
    resize.MEMORY: "--memory",
    resize.SM: "--cores",
    resize.BUDGET: "--budget",
    resize.ANY: "--memory/--cores/--budget",
}


class FlagError(ValueError):
    """Bad input to ``vgpu limits``: the message starts with the flag at fault."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


def _where(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "region", nargs="?", help="the container's region file (older form; CUDA_DEVICE_MEMORY_SHARED_CACHE)"
    )
    sub.add_argument(
        "--container-dir",
        type=Path,
        help=f"the container's host folder /var/lib/vgpu/containers/<pod-uid>_<container> "
        f"({REGION_FILE_NAME} inside)",
    )


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="limits_command", metavar="ACTION", required=True)
    show = sub.add_parser("show", help="limits, usage, compute time, priority and processes of a container")
    _where(show)
    show.add_argument("--json", action="store_true", help="print JSON instead of a table")
    change = sub.add_parser("set", help="change one device's limits while the container runs")
    _where(change)
    change.add_argument("--device", type=int, required=True, help="device index in the container (0, 1, ...)")
    change.add_argument("--memory", help="memory limit: MiB, or a number with b, k, m or g (0 = none)")
    change.add_argument(
        "--cores", "--sm", dest="cores", type=int, help="SM limit in percent, 0..100 (0 = none)"
    )
    change.add_argument(
        "--budget",
        help="device memory before spilling to host: MiB, or with b, k, m, g (0 = card's free memory)",
    )


def parse_mib(text: str, flag: str) -> int:
    """Bytes from ``--memory``/``--budget``: a plain number is MiB, a suffix gives the unit."""
    value = text.strip().lower()
    scale = _UNITS.get(value[-1:])
    digits = value[:-1] if scale else value
    if value.startswith("-") and digits[1:].isdigit():
        raise FlagError(flag, f"{text!r} is negative; give a size >= 0 (0 = no limit)")
    if not (digits.isascii() and digits.isdigit()):
        raise FlagError(flag, f"{text!r} is not a size; give MiB (4096) or a number with b, k, m or g (4g)")
    size = int(digits) * (scale or 1 << 20)
    if size > MAX_BYTES:
        raise FlagError(
            flag,
            f"{text!r} is more than 2^64-1 bytes (16 EiB), the most a limit can hold; give a smaller size",
        )
    return size


def _region_path(args: argparse.Namespace) -> Path:
    if args.region and args.container_dir:
        raise FlagError("--container-dir", "give either --container-dir or a region file, not both")
    if args.container_dir is not None:
        return Path(args.container_dir) / REGION_FILE_NAME
    if args.region:
        return Path(args.region)
    raise FlagError(
        "--container-dir",
        "name the container: --container-dir /var/lib/vgpu/containers/<pod-uid>_<container>",
    )


def _mib(value: int) -> str:
    return f"{value / (1 << 20):.0f} MiB"


def _seconds(ns: int) -> str:
    return f"{ns / 1e9:.3f} s"


def _flags(flags: int) -> str:
    bits = ((FLAG_YIELD, "yield"), (FLAG_ALONE, "alone"), (FLAG_GUARD, "guard"))
    names = [n for bit, n in bits if flags & bit]
    return ",".join(names) or "-"


def _table(snap: Snapshot) -> str:
    policy = {0: "cap", 1: "elastic"}.get(snap.sm_policy, str(snap.sm_policy))
    lines = [f"priority {snap.priority} ({'high' if snap.priority == 0 else 'normal'}), sm policy {policy}"]
    widths = (-7, -42, 10, 10, 10, 10, 6, 11, 11, 11)

    def row(*cells: object) -> str:
        return " ".join(
            f"{c!s:<{-w}}" if w < 0 else f"{c!s:>{w}}" for c, w in zip(cells, widths, strict=True)
        )

    lines.append(
        row("device", "uuid", "limit", "used", "budget", "spilled", "cores", "busy", "throttled", "flags")
    )
    for d in snap.devices:
        lines.append(
            row(
                d.index,
                d.uuid or "-",
                _mib(d.limit_bytes) if d.limit_bytes else "none",
                _mib(d.used_bytes),
                _mib(d.budget_bytes) if d.budget_bytes else "card",
                _mib(d.spilled_bytes),
                f"{d.sm_limit}%" if d.sm_limit else "none",
                _seconds(d.busy_ns),
                _seconds(d.throttled_ns),
                _flags(d.flags),
            )
        )
    for p in snap.processes:
        spilled = f" (spilled {', '.join(_mib(s) for s in p.spilled_bytes)})" if any(p.spilled_bytes) else ""
        lines.append(f"process {p.pid}: " + ", ".join(_mib(u) for u in p.used_bytes) + spilled)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        path = _region_path(args)
        if args.limits_command == "show":
            grant_file = grant_beside(path)
            granted = read_grant(grant_file) if grant_file is not None else None
            if granted is None or path.exists():
                with Region(path) as region:
                    snap = region.snapshot()
            else:  # granted, but no CUDA process has created the region yet
                snap = Snapshot((), ())
            differ: list[str] = []
            if granted is not None:
                snap, differ = as_granted(snap, granted)
            if args.json:
                grant_name = str(grant_file) if grant_file else None
                print(json.dumps(asdict(snap) | {"grant": grant_name, "region_differs": differ}, indent=2))
            else:
                print(_table(snap))
                print(f"limits granted in {grant_file}" if grant_file else "no grant: limits from the region")
                for line in differ:
                    print(f"the region's copy differs from the grant: {line} (the hook puts it back)")
            return 0
        change = apply_limits(
            path,
            args.device,
            memory_bytes=None if args.memory is None else parse_mib(args.memory, "--memory"),
            sm_percent=args.cores,
            budget_bytes=None if args.budget is None else parse_mib(args.budget, "--budget"),
        )
        for note in change.notes:
            print(f"vgpu limits set: {note}")
        return 0
    except FlagError as err:
        print(f"vgpu limits {args.limits_command}: {err}", file=sys.stderr)
        return 2
    except LimitError as err:
        flag = FLAGS.get(err.field, err.field)
        print(f"vgpu limits {args.limits_command}: {flag}: {err.reason}", file=sys.stderr)
        return 2
    except RegionError as err:
        print(
            f"vgpu limits {args.limits_command}: {err} (is --container-dir the folder of a container that "
            "has started a CUDA process?)",
            file=sys.stderr,
        )
        return 2
