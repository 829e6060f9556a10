"""The GPU tests' figures: each test prints one JSON line, and appends it to
$VGPU_GPU_REPORT/gpu_figures.jsonl where that folder is given."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def record(kind: str, **figures: Any) -> None:
    folder = os.environ.get("VGPU_GPU_REPORT")
    line = json.dumps({"test": kind, **figures})
    print(line)
    if folder:
        with open(Path(folder) / "gpu_figures.jsonl", "a") as out:
            out.write(line + "\n")
