"""Run one Python harness of fuzz/properties.py under atheris (libFuzzer's engine, for Python).

    .venv/bin/python fuzz/run_atheris.py NAME [libFuzzer flags] [CORPUS_DIR...]

NAME is a key of ``fuzz.properties.TARGETS``; the flags and corpus folders are libFuzzer's
(``-max_total_time=20``, ``-print_final_stats=1``...). ``make fuzz`` runs every harness this way.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

try:
    import atheris
except ImportError:
    sys.exit(
        "fuzz: atheris is not installed; `make venv` installs it with the dev extra (pip install atheris)"
    )

with atheris.instrument_imports(include=["vgpu", "fuzz", "gunicorn.http"]):
    from fuzz.properties import TARGETS


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: run_atheris.py NAME [libFuzzer flags]; NAME is one of {', '.join(TARGETS)}")
    name = sys.argv.pop(1)
    atheris.Setup(sys.argv, TARGETS[name])
    atheris.Fuzz()


if __name__ == "__main__":
    main()
