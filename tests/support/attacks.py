"""What a determined tenant does from inside its container, for the enforcement tests."""

from __future__ import annotations

import mmap
import struct
import threading
from pathlib import Path

from vgpu.hookabi.layout import HEADER_LAYOUT


class BucketWriter:
    """A second process of the container as the attack has it: the region's compute bucket written
    full every millisecond (here a thread of the test, writing through its own map of the file)."""

    def __init__(self, region: Path) -> None:
        self.region = region
        self.stop = threading.Event()
        self.writes = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.region.exists() or self.region.stat().st_size < HEADER_LAYOUT.size:
            if self.stop.wait(0.001):
                return
        with self.region.open("r+b") as f, mmap.mmap(f.fileno(), HEADER_LAYOUT.size) as m:
            tokens = HEADER_LAYOUT.offsets["tokens"]
            while not self.stop.wait(0.001):
                struct.pack_into("<q", m, tokens, 1 << 60)
                self.writes += 1

    def __enter__(self) -> BucketWriter:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
