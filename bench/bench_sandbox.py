"""Figures for the sandbox: warm `make setup` time, and `vgpu sandbox up`/`down` times by size.

Run: .venv/bin/python bench/bench_sandbox.py [--nodes 3 20] [--repeat 3]
Prints one line per measurement; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from vgpu_sandbox.binaries import repo_root
from vgpu_sandbox.cluster import Sandbox, Spec


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, nargs="+", default=[3, 20])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    warm = timed(
        lambda: subprocess.run(["bash", "tools/build.sh"], cwd=repo_root(), check=True, capture_output=True)
    )
    print(f"tools/build.sh with every binary cached (warm set-up): {warm:.2f}s")

    for n in args.nodes:
        for product in (False, True):
            ups, downs = [], []
            for _ in range(args.repeat):
                with tempfile.TemporaryDirectory(prefix="vgpu-bench-") as tmp:
                    sandbox = Sandbox(Path(tmp) / "sb")
                    try:
                        ups.append(sandbox.up(Spec(nodes=n, product=product)))
                    finally:
                        downs.append(timed(sandbox.down))
            what = "with the product" if product else "control plane only"
            print(
                f"sandbox up, {n} nodes, {what}: median {statistics.median(ups):.2f}s "
                f"(min {min(ups):.2f}, max {max(ups):.2f}, n={len(ups)}); "
                f"down: median {statistics.median(downs):.2f}s"
            )


if __name__ == "__main__":
    main()
