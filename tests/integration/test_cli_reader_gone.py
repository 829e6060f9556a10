"""Every entry point ends quietly when the reader of its output went away (``| head -3``), as a
Unix tool killed by SIGPIPE does: exit 141, nothing on stderr. Issue 37: ``vgpu sandbox status |
head -3`` printed "unexpected BrokenPipeError ... a bug: please report it"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import VGPU
from vgpu.core.output import READER_GONE_EXIT, run_command

PY = [sys.executable, "-m"]


def _with_reader_gone(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``argv`` with stdout a pipe whose reading end is already closed."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            argv, stdout=write, stderr=subprocess.PIPE, text=True, timeout=60, env={**os.environ, **env}
        )
    finally:
        os.close(write)


@pytest.mark.parametrize(
    "argv",
    [
        [*VGPU, "sandbox", "status"],
        [*VGPU, "sandbox", "status", "--json"],
        [*PY, "vgpu_sandbox.demo", "--skip-playbook"],  # its first line comes before it starts anything
    ],
    ids=["vgpu sandbox status", "vgpu sandbox status --json", "make demo"],
)
def test_an_entry_point_whose_reader_went_away_ends_quietly(argv: list[str], tmp_path: Path) -> None:
    sandbox = tmp_path / "no-sandbox"
    done = _with_reader_gone(argv, {"VGPU_SANDBOX_DIR": str(sandbox)})
    assert (done.returncode, done.stderr) == (READER_GONE_EXIT, "")
    assert not sandbox.exists()  # the demo started nothing


def test_a_broken_pipe_that_is_not_the_output_is_still_an_error() -> None:
    """A socket's EPIPE is not the reader going away: it reaches the command's error handling."""

    def fails() -> int:
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(BrokenPipeError):
        run_command(fails)
