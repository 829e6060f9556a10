"""Child processes of a test: started in their own session, stopped with SIGTERM to the group, a
grace period, then SIGKILL (the sandbox's own :func:`vgpu_sandbox.procs.stop_group`)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from vgpu_sandbox.procs import stop_group as stop

__all__ = ["VGPU", "running", "start", "stop", "vgpu"]

VGPU = [sys.executable, "-m", "vgpu.commands.cli"]  # the `vgpu` command of this checkout


def start(argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``argv`` in a session of its own (so :func:`stop` reaches its children too), its stdout and
    stderr appended to ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            start_new_session=True,
        )


@contextlib.contextmanager
def running(
    argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None, grace: float = 30.0
) -> Iterator[subprocess.Popen[bytes]]:
    """:func:`start`, and :func:`stop` when the block ends however it ends."""
    proc = start(argv, log, env)
    try:
        yield proc
    finally:
        stop(proc, grace=grace)


def vgpu(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``vgpu ARGS`` run to its end, output captured as text, ``env`` over this process's."""
    return subprocess.run(
        [*VGPU, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )
