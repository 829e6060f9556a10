"""A short temporary folder: a unix socket's path must stay within 107 bytes, and pytest's own
``tmp_path`` (``/tmp/pytest-of-USER/pytest-N/test_a_long_name0/``) comes close on its own."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def short_dir(prefix: str = "vgpu-t-") -> Iterator[Path]:
    """A fresh folder ``/tmp/<prefix>XXXXXXXX``, removed with everything in it at the end."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
