"""Many processes of one container starting CUDA at the same moment, bare and under the hook (issue 23).

N processes (default 300) of native/hook's b_many wait at a barrier (a pipe they read until end
of file) and are released together; each then goes through a CUDA program's start-up (cuInit, the
devices enumerated, cuDeviceTotalMem, the primary context, one small allocation, cuMemGetInfo)
and reports when it was done. Bare: no hook. Hooked: as Allocate lays out a container: a grant
naming a region file that does not exist yet (the first process creates it, all race for it),
the hook preloaded. Start-up is the time from the release to a process's report. While all hold
what they got, the region's usage (the sum of the hook's charges) is read against the grant, and
with --gpu the driver's own figure for the processes; after they exit, the region must be empty.

Over the stub driver (the default) every process asks for a context; the grant fits --fit of
them (default: all). With --gpu the card must never be asked for more than it holds: only the
first --attempts processes (default 200, fewer where the card has less free memory) ask for a
context at all, the others stop after the device queries, and the grant fits --fit (default 150)
contexts of 640 MiB and their allocation, at most 100 GiB; the hook refuses the rest of the
attempts before the driver is asked. The bare run asks for the same --attempts contexts, which
the card holds (about 518 MiB each on an H200).

    python3 bench/bench_many.py                 # stub driver, 300 processes, 3 rounds
    python3 bench/bench_many.py --gpu --rounds 1
    python3 bench/bench_many.py --hook /path/to/other/libvgpu.so   # another build of the hook
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.many import (  # noqa: E402
    BUILD,
    MIB,
    Container,
    Round,
    Start,
    base_env,
    gpu_plan,
    held_on_gpu,
    start_together,
    summary,
)

Rounds = dict[str, list[Round[dict[str, int]]]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3, help="bare and hooked, alternating")
    parser.add_argument("--gpu", action="store_true", help="the real driver (default: the stub)")
    parser.add_argument("--fit", type=int, default=0, help="contexts the grant fits (stub: all; --gpu: 150)")
    parser.add_argument("--attempts", type=int, default=200, help="--gpu: processes that ask for a context")
    parser.add_argument("--alloc-mib", type=int, default=2, help="each process's one allocation")
    parser.add_argument("--hook", type=Path, default=BUILD / "libvgpu.so", help="the libvgpu.so to measure")
    parser.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    args = parser.parse_args()
    subprocess.run(["make", "-s", "-C", str(BUILD.parent)], check=True)
    base = base_env(stub=not args.gpu)
    if args.gpu:
        plan = gpu_plan(args.procs, args.attempts, args.fit or 150, args.alloc_mib)
    else:
        plan = {"attempts": args.procs, "fit": args.fit or args.procs}
    limit = plan["fit"] * (640 + args.alloc_mib) * MIB
    attempts = int(plan["attempts"])
    results: Rounds = {"bare": [], "hooked": []}
    with tempfile.TemporaryDirectory(prefix="vgpu-many-") as tmp:
        box = Container(Path(tmp) / "container", limit_bytes=limit)

        def look(starts: list[Start]) -> dict[str, int]:
            seen = held_on_gpu({s.pid for s in starts}) if args.gpu else {}
            if box.region.exists():
                snap = box.snapshot()
                seen |= {"region_used": snap.devices[0].used_bytes, "slots": len(snap.processes)}
            return seen

        for r in range(args.rounds):
            for name in ("bare", "hooked") if r % 2 == 0 else ("hooked", "bare"):
                box.reset()
                env = box.env(base, LD_PRELOAD=str(args.hook)) if name == "hooked" else base
                one = start_together(
                    args.procs,
                    env,
                    Path(tmp) / name,
                    modes=lambda i: "ctx" if i < attempts else "query",
                    alloc_bytes=args.alloc_mib * MIB,
                    while_held=look,
                )
                if name == "hooked":
                    after = box.snapshot()
                    assert one.seen is not None
                    one.seen["after_used"] = after.devices[0].used_bytes
                    one.seen["after_slots"] = len(after.processes)
                results[name].append(one)
    report(args, plan, limit, results)
    return 0


def report(args: argparse.Namespace, plan: dict[str, int], limit: int, results: Rounds) -> None:
    figures: dict[str, object] = {
        "procs": args.procs,
        "rounds": args.rounds,
        "driver": "gpu" if args.gpu else "stub",
        "grant_mib": limit // MIB,
        **plan,
    }
    for name, rounds in results.items():
        pooled = summary([t for one in rounds for t in one.startup_s()])
        per_round_p99 = [round(one.stats()["p99"], 4) for one in rounds]
        failed = sum(1 for one in rounds for s in one.starts if s.failed) + sum(
            1 for one in rounds for rc in one.returncodes if rc != 0
        )
        reported = [len(one.starts) for one in rounds]
        figures[name] = {
            **{k: round(v, 4) for k, v in pooled.items()},
            "p99_per_round": per_round_p99,
            "reported": reported,
            "failed": failed,
            "contexts": [one.contexts for one in rounds],
            "refused": [one.refused for one in rounds],
            "seen": [one.seen for one in rounds],
        }
    if args.json:
        print(json.dumps(figures))
        return
    print(f"{args.procs} processes released together, {args.rounds} rounds, {figures['driver']} driver")
    print(f"grant: {limit // MIB} MiB ({plan['fit']} contexts of 640 MiB + {args.alloc_mib} MiB)")
    print(f"{'':8} {'p50 s':>8} {'p99 s':>8} {'max s':>8}  contexts  refused  failed")
    for name in results:
        f = figures[name]
        assert isinstance(f, dict)
        print(
            f"{name:8} {f['p50']:8.3f} {f['p99']:8.3f} {f['max']:8.3f}  "
            f"{'/'.join(map(str, f['contexts'])):>8}  {'/'.join(map(str, f['refused'])):>7}  {f['failed']:>6}"
        )
    for seen in figures["hooked"]["seen"]:  # type: ignore[index]
        held = seen.get("region_used", 0) // MIB
        line = f"hooked round: the hook's charges together {held} MiB of the grant's {limit // MIB} MiB"
        line += f", {seen.get('slots')} slots; after exit {seen.get('after_used')} bytes"
        line += f", {seen.get('after_slots')} slots"
        if "driver_mib" in seen:
            line += f"; the driver says {seen['driver_mib']} MiB"
        print(line)


if __name__ == "__main__":
    raise SystemExit(main())
