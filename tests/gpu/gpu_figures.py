"""The GPU tests' figures: each test prints one JSON line, and appends it to
$VGPU_GPU_REPORT/gpu_figures.jsonl where that folder is given."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path
from typing import Any


def record(kind: str, **figures: Any) -> None:
    folder = os.environ.get("VGPU_GPU_REPORT")
    line = json.dumps({"test": kind, **figures})
    print(line)
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / "gpu_figures.jsonl", "a") as out:
            out.write(line + "\n")


class Clocks:
    """The card's SM clock (MHz) and power draw (W) sampled by nvidia-smi every 200 ms while the
    block runs: a compute-bound loop at a low duty cycle runs at higher clocks than one that holds
    the card at its power limit, which moves throughput without moving time shares."""

    def __enter__(self) -> Clocks:
        query = ["--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "200"]
        self.proc = subprocess.Popen(
            ["nvidia-smi", "-i", "0", *query],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=30)
        samples = [line.split(", ") for line in out.splitlines() if line.count(",") == 1]
        try:
            self.sm_mhz = statistics.median(float(a) for a, _ in samples)
            self.power_w = statistics.median(float(b) for _, b in samples)
        except (ValueError, statistics.StatisticsError):
            self.sm_mhz = self.power_w = float("nan")
