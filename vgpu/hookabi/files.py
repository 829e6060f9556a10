"""The one atomic file writer of the node side: a file holds its new bytes whole or not at all.

The bytes go to a temporary file in the same folder (``.<name>.<random>.tmp``, mode ``mode``
whatever the umask), which is flushed to disk, renamed over ``path`` and the folder flushed
too, so that a reader never sees half a file and a crash, of the process or the machine, leaves
the old file or the new one (and at worst a ``.tmp`` file no reader opens). The rename replaces
the name, never the bytes: a process that maps or holds the old file keeps the old inode.

Its writers: the grant when it is made (vgpu/hookabi/grant.py), the hook's installed versions
and records (vgpu/node/hooklib.py), the fake cards' MIG state and driver caps
(vgpu/node/fake_mig.py, fake_memcap.py), the DRA plugin's CDI specs, claim records and
checkpoint (vgpu/dra/cdi.py). Lives here, on the lowest floor that writes such a file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

TMP_SUFFIX = ".tmp"


def write_atomic(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> None:
    """``path`` holds ``data`` with ``mode``, whole or not at all, on disk when this returns.
    The folder must exist; ``OSError`` as the system gives it, with no temporary file left."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)  # mkstemp's 0600, whatever the umask
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
