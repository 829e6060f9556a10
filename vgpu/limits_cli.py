"""`vgpu limits`: show or change a running container's limits through its region file.

    vgpu limits show /var/lib/vgpu/containers/<pod-uid>_<container>/vgpu.region [--json]
    vgpu limits set  REGION --device 0 --memory 4096m [--sm 30]

A new memory limit holds from the next allocation of every process of the container (live
resize); memory already taken is never taken back, so a limit below current usage refuses new
allocations until usage falls under it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from vgpu.region import Region, RegionError, parse_size


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="limits_command", metavar="ACTION", required=True)
    show = sub.add_parser("show", help="limits, usage and processes of one region file")
    show.add_argument("region", help="the container's region file (CUDA_DEVICE_MEMORY_SHARED_CACHE)")
    show.add_argument("--json", action="store_true", help="print JSON instead of a table")
    change = sub.add_parser("set", help="change one device's limits while the container runs")
    change.add_argument("region", help="the container's region file (CUDA_DEVICE_MEMORY_SHARED_CACHE)")
    change.add_argument("--device", type=int, required=True, help="device index in the container (0, 1, ...)")
    change.add_argument("--memory", help="new memory limit: bytes, or a number with k, m or g (0 = none)")
    change.add_argument("--sm", type=int, help="new SM limit in percent (0 = none)")


def _mib(value: int) -> str:
    return f"{value / (1 << 20):.0f} MiB"


def run(args: argparse.Namespace) -> int:
    try:
        if args.limits_command == "show":
            with Region(args.region) as region:
                snap = region.snapshot()
            if args.json:
                print(json.dumps(asdict(snap), indent=2))
                return 0
            print(f"{'device':<7} {'uuid':<42} {'limit':>12} {'used':>12} {'sm limit':>9}")
            for d in snap.devices:
                limit = _mib(d.limit_bytes) if d.limit_bytes else "none"
                sm = f"{d.sm_limit}%" if d.sm_limit else "none"
                print(f"{d.index:<7} {d.uuid or '-':<42} {limit:>12} {_mib(d.used_bytes):>12} {sm:>9}")
            for p in snap.processes:
                print(f"process {p.pid}: " + ", ".join(_mib(u) for u in p.used_bytes))
            return 0
        if args.memory is None and args.sm is None:
            print("vgpu limits set: give --memory and/or --sm", file=sys.stderr)
            return 2
        memory = None
        if args.memory is not None:
            try:
                memory = parse_size(args.memory)
            except ValueError as err:
                print(f"vgpu limits set: --memory: {err}", file=sys.stderr)
                return 2
        with Region(args.region, writable=True) as region:
            if memory is not None:
                region.set_limit(args.device, memory)
            if args.sm is not None:
                region.set_sm_limit(args.device, args.sm)
        return 0
    except RegionError as err:
        print(f"vgpu limits: {err}", file=sys.stderr)
        return 1
