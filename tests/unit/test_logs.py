"""The long-running commands' logging (vgpu.core.logs): urllib3's retry warnings left out.

Each case runs in a fresh interpreter, as a command starts: ``logging.basicConfig`` acts once
per process, and pytest's own handlers would take the records here."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import logging, sys
from vgpu.core import logs
logs.configure(sys.argv[1])
logging.getLogger("urllib3.connectionpool").warning("Retrying (Retry(total=2)) after connection broken")
logging.getLogger("urllib3.connectionpool").error("Connection pool is full")
logging.getLogger("vgpu.kube.client").warning("GET /api/v1/nodes: unreachable")
"""


def _logged(level: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, level], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stderr


def test_urllib3_retry_warnings_are_left_out_but_ours_and_its_errors_stay() -> None:
    err = _logged("info")
    assert "Retrying" not in err
    assert "ERROR urllib3.connectionpool: Connection pool is full" in err
    assert "WARNING vgpu.kube.client: GET /api/v1/nodes: unreachable" in err


def test_at_debug_urllib3_says_everything() -> None:
    err = _logged("DEBUG")
    assert "WARNING urllib3.connectionpool: Retrying (Retry(total=2)) after connection broken" in err
