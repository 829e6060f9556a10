"""A command whose reader went away (``vgpu status | head -3``) ends quietly, as Unix tools do.

Python ignores SIGPIPE, so a write to a pipe nobody reads any more raises BrokenPipeError (and
Python's own flush at exit prints ``Exception ignored ...``) where a C tool is killed by the
signal without a word. :func:`run_command` gives every entry point the tool's behaviour: no
message, exit 141 (128 + SIGPIPE, what a shell reports for such a tool under ``pipefail``).
"""

from __future__ import annotations

import os
import select
import signal
import sys
from collections.abc import Callable

READER_GONE_EXIT = 128 + signal.SIGPIPE


def stdout_reader_gone() -> bool:
    """Whether standard output is a pipe or socket whose reading end has closed."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no stdout, or not a file
        return False


def run_command(main: Callable[[], int]) -> int:
    """``main()``'s exit code, its output flushed before it is returned; :data:`READER_GONE_EXIT`
    when the output's reader went away. A BrokenPipeError from anything else (a socket) is raised."""
    try:
        code = main()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        if not stdout_reader_gone():
            raise
        # what is still buffered for stdout would fail again at exit: let it go nowhere
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return READER_GONE_EXIT
