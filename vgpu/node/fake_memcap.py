"""The fake NVML's driver cap (``vgpu.node.memcap``): answers as an r615+ driver would, and
records every call where a test can read it.

In the fake GPU file (``vgpu.node.fake_nvml``)::

    gpus:
      - uuid: GPU-...
        driverMemoryLimits: true     # this card's "driver" has nvmlDeviceSetMemoryLimits_v1
                                     # (default false: a driver before r615, as on 580)
    memoryLimitsLog: /tmp/caps.jsonl # optional: one JSON object per call, appended

Per call (``calls``, and a line of the log): ``{"op": "set"|"get", "uuid", "cgroup", "soft",
"hard", "result"}``, ``result`` being ``ok`` or the error's word (``vgpu.node.memcap.CODES``).
With a ``processDir``, the hard limits set are written where the stub driver holds the cgroup's
processes to them (``<processDir>/caps/<cgroup folder's name>``, one ``<cgroup> <uuid> <hard>``
line per card; native/hook/stub/stub_cuda.c): an allocation past the cap then fails there, as it
would in an r615 driver. The fake refuses as NVML would: ``missing`` on a card without ``driverMemoryLimits``,
``not-supported`` on a MIG device (a UUID starting ``MIG-``), ``no-permission`` unless the
process runs as root, ``not-found`` for a cgroup folder that does not exist (removing the
cgroup clears its limits, as the driver's do).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vgpu.core.errors import ConfigError
from vgpu.hookabi.files import write_atomic
from vgpu.node.memcap import LIMIT_MAX, CapError, Limits, error_of

_CODE = {"missing": 13, "not-supported": 3, "no-permission": 4, "not-found": 6, "invalid-argument": 2}


@dataclass(frozen=True)
class CapCall:
    op: str  # set or get
    uuid: str
    cgroup: str
    soft: int
    hard: int
    result: str  # ok, or the CapError's code


def parse_caps(doc: Any, source: str) -> tuple[frozenset[str], Path | None]:
    """The cards whose driver caps (``driverMemoryLimits``) and ``memoryLimitsLog``; raises
    ConfigError naming the field."""
    capped: set[str] = set()
    for i, item in enumerate(doc.get("gpus") or []):
        value = item.get("driverMemoryLimits", False) if isinstance(item, dict) else False
        if not isinstance(value, bool):
            raise ConfigError(
                source, f"gpus[{i}].driverMemoryLimits", f"must be true or false, got {value!r}"
            )
        if value:
            capped.add(str(item.get("uuid")))
    log = doc.get("memoryLimitsLog")
    if log is not None and (not isinstance(log, str) or not log.startswith("/")):
        raise ConfigError(source, "memoryLimitsLog", f"must be an absolute path, got {log!r}")
    return frozenset(capped), Path(log) if log else None


class FakeCaps:
    """``MemoryCaps`` for the fake NVML's cards."""

    def __init__(
        self,
        capped: frozenset[str],
        log: Path | None = None,
        euid: Callable[[], int] = os.geteuid,
        process_dir: Path | None = None,
    ) -> None:
        self.capped = capped
        self.log = log
        self.euid = euid
        self.process_dir = process_dir
        self.calls: list[CapCall] = []
        self._limits: dict[tuple[str, str], tuple[int, int]] = {}
        self._lock = threading.Lock()

    def memory_caps(self, uuid: str) -> bool:
        return uuid in self.capped and not uuid.startswith("MIG-")

    def _check(self, uuid: str, cgroup: str) -> str | None:
        if uuid.startswith("MIG-"):
            return "not-supported"
        if uuid not in self.capped:
            return "missing"
        if self.euid() != 0:
            return "no-permission"
        if not Path(cgroup).is_dir():
            return "not-found"
        return None

    def _record(self, call: CapCall) -> None:
        with self._lock:
            self.calls.append(call)
            if self.log is not None:
                with self.log.open("a") as out:
                    out.write(json.dumps(call.__dict__, sort_keys=True) + "\n")

    def set_memory_limits(self, uuid: str, cgroup: str, soft: int, hard: int) -> None:
        refused = self._check(uuid, cgroup)
        if refused is None and (soft > hard or hard <= 0):
            refused = "invalid-argument"
        if refused == "not-found":
            with self._lock:  # a removed cgroup's limits went with it
                self._limits.pop((uuid, cgroup), None)
                self._tell_stub(cgroup)
        if refused is not None:
            self._record(CapCall("set", uuid, cgroup, soft, hard, refused))
            raise error_of(_CODE[refused], f"setting {uuid}'s limit of {cgroup}")
        with self._lock:
            if soft == 0 and hard == LIMIT_MAX:
                self._limits.pop((uuid, cgroup), None)
            else:
                self._limits[(uuid, cgroup)] = (soft, hard)
            self._tell_stub(cgroup)
        # recorded once it took effect: a reader that sees the call sees the stub's file as it left it
        self._record(CapCall("set", uuid, cgroup, soft, hard, "ok"))

    def _tell_stub(self, cgroup: str) -> None:
        """The cgroup's hard limits where the stub driver holds its processes to them
        (``<processDir>/caps/<the folder's name>``: ``<cgroup> <uuid> <hard>`` lines)."""
        if self.process_dir is None:
            return
        caps = self.process_dir / "caps"
        caps.mkdir(exist_ok=True)
        lines = [f"{c} {u} {hard}\n" for (u, c), (_, hard) in sorted(self._limits.items()) if c == cgroup]
        target = caps / Path(cgroup).name
        if not lines:
            target.unlink(missing_ok=True)
            return
        write_atomic(target, "".join(lines).encode(), 0o644)

    def get_memory_limits(self, uuid: str, cgroup: str) -> Limits:
        refused = self._check(uuid, cgroup)
        with self._lock:
            if refused == "not-found":
                self._limits.pop((uuid, cgroup), None)  # a removed cgroup's limits go with it
            soft, hard = self._limits.get((uuid, cgroup), (0, LIMIT_MAX))
        self._record(CapCall("get", uuid, cgroup, soft, hard, refused or "ok"))
        if refused is not None:
            raise error_of(_CODE[refused], f"reading {uuid}'s limit of {cgroup}")
        return Limits(soft, hard)


def read_log(path: Path) -> list[CapCall]:
    """The calls a fake NVML (maybe in another process) wrote to its ``memoryLimitsLog``."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [CapCall(**json.loads(line)) for line in lines if line.strip()]


__all__ = ["CapCall", "CapError", "FakeCaps", "parse_caps", "read_log"]
