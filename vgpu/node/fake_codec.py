"""The fake NVML's media-engine samples: what ``nvmlDeviceGetProcessUtilization`` (``decUtil``,
``encUtil``) and ``nvmlDeviceGetProcessesUtilizationInfo`` (also ``jpgUtil``, ``ofaUtil``) give a
process, read from a file beside the stub driver's per-process files in ``processDir``.

``<pid>@<start time>.codec`` (named as the process's memory file, ``vgpu.node.fake_nvml``), one
line per card::

    <uuid or index> <dec> <enc> [<jpg> <ofa>]

in percent of the sample period (0..100). No stub writes it: a test (or the sandbox's user)
writes it for a process to stand for the driver's samples of a decode or encode workload.
"""

from __future__ import annotations

from pathlib import Path

from vgpu.node.discovery import Codec


def read_codec(path: Path, keys: set[str]) -> Codec | None:
    """The first line of ``path`` naming one of ``keys`` (the card's UUID or index); None when
    there is no such file or line, or the line is malformed (the driver gave no sample)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        words = line.split()
        if not words or words[0] not in keys:
            continue
        values = words[1:]
        if len(values) not in (2, 4) or not all(v.isdigit() and int(v) <= 100 for v in values):
            return None
        dec, enc, *rest = (int(v) for v in values)
        return Codec(dec, enc, *rest) if rest else Codec(dec, enc)
    return None
