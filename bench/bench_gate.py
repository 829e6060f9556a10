"""The node's compute gate on the simulated driver (tests/support/gatesim.py): how close it holds
a bucket rewriter to its grant, and how often it holds containers within their grants on a card
shared in time slices. The real ComputeEnforcer and grant files; only the driver is simulated
(200 ms samples delivered 0-300 ms late, or as the H200 delivered them: one 250 ms late and the
next on time). No GPU: the same figures on the H200 come from tests/gpu/test_compute_gate_gpu.py.

Printed, one line each, then one JSON line of everything:
- a bucket rewriter (grant 30 %) alone: its share of 10 s and of 30 s over --runs seeds (min,
  median, max); the same with the H200's delivery;
- beside a neighbour within its grant (50 %, lumps at 40 %): the rewriter's share of 30 s (its one
  1 s burst of the shared card's bucket included) and whether the neighbour was ever held;
- two containers within their grants sharing the card (30/70, the H200 pair's lumps drawn
  independently: a pessimistic model): in how many of --pair-runs runs of 10 s any gate was
  written, for the lumps as measured and a busier draw.

    python3 bench/bench_gate.py                 # 16 runs, 40 pair runs: about 10 s
    python3 bench/bench_gate.py --runs 4 --pair-runs 10
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.gatesim import PAIR, Slices, pair, rewriter, run, sparse  # noqa: E402

MODELS = {
    "pair (as measured, a little busier)": PAIR,
    "busier (near both grants)": {101: (30, sparse(0.31, 0.84, 0.91)), 102: (70, sparse(0.85, 0.70, 0.93))},
}


def spread(values: list[float]) -> dict[str, float]:
    ordered = [round(v, 1) for v in sorted(values)]
    return {"min": ordered[0], "median": round(statistics.median(values), 1), "max": ordered[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=16, help="seeds per rewriter figure")
    ap.add_argument("--pair-runs", type=int, default=40, help="seeds per pair model")
    args = ap.parse_args()
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        alone10 = [rewriter(work / "a10", s, 10)[0].share(101, 10) for s in range(args.runs)]
        alone30 = [rewriter(work / "a30", s, 30)[0].share(101, 30) for s in range(max(1, args.runs // 4))]
        h200 = []
        for s in range(max(1, args.runs // 4)):
            sim = Slices(work / f"h{s}", s, delays=itertools.cycle((250_000_000, 0)))
            sim.lumpy(101, 30, lambda rng: 1.0)
            run(sim, "kill", 10)
            h200.append(sim.share(101, 10))
        beside, neighbour_held = [], 0
        for s in range(max(1, args.runs // 4)):
            sim, e = rewriter(work / "b", s, 30, neighbour=True)
            beside.append(sim.share(101, 30))
            neighbour = [a for a in e.accounts.values() if a.owner.pod == "pod102"]
            neighbour_held += any(a.closures or a.hold_until for a in neighbour)
        out["rewriter"] = {
            "grant_pct": 30,
            "alone_10s_pct": spread(alone10),
            "alone_30s_pct": spread(alone30),
            "h200_delivery_10s_pct": spread(h200),
            "beside_neighbour_30s_pct": spread(beside),
            "neighbour_held_runs": neighbour_held,
        }
        print(f"rewriter at 30 %, alone, 10 s ({args.runs} runs): {spread(alone10)}")
        print(f"rewriter at 30 %, alone, 30 s: {spread(alone30)}")
        print(f"rewriter at 30 %, the H200's delivery, 10 s: {spread(h200)}")
        print(f"rewriter at 30 % beside a neighbour, 30 s: {spread(beside)}", end="")
        print(f"; the neighbour held in {neighbour_held} runs")
        pairs: dict[str, int] = {}
        for name, model in MODELS.items():
            held = 0
            for s in range(args.pair_runs):
                _, e = pair(work / f"p{len(pairs)}", 1000 + s, model, "report")
                held += bool(e.gate_writes)
            pairs[name] = held
            print(f"honest 30/70 pair, {name}: a gate written in {held} of {args.pair_runs} runs of 10 s")
        out["pair_runs"], out["pair_held_runs"] = args.pair_runs, pairs
    print(json.dumps(out))


if __name__ == "__main__":
    main()
