"""The driver's own device-memory cap per cgroup (NVML ``nvmlDeviceSetMemoryLimits_v1``, driver r615+).

NVML's reference: ``nvmlDeviceSetMemoryLimits_v1(device, nvmlSetMemoryLimits_v1_t *)`` sets, for
the cgroup (v2) whose sysfs folder's full path is ``nameSpace``, a soft and a hard limit in bytes
of the device memory its processes may allocate on the card; ``nvmlDeviceGetMemoryLimits_v1``
reads them back with ``currentUsed``. Root only, Linux only, never on a MIG device's handle;
softLimit 0 with hardLimit ``NVML_DEVICE_MEMORY_LIMIT_MAX`` (all ones) clears them, and so does
removing the cgroup. The structs (nvml.h) have no version word::

    typedef struct { const char *nameSpace; unsigned long long softLimit, hardLimit; }
        nvmlSetMemoryLimits_v1_t;                                  // 24 bytes on x86_64
    typedef struct { const char *nameSpace; unsigned long long softLimit, hardLimit, currentUsed; }
        nvmlGetMemoryLimits_v1_t;                                  // 32 bytes

A driver before r615 has no such symbol: NVML answers ``NVML_ERROR_FUNCTION_NOT_FOUND`` (13),
which :class:`CapError` names ``missing``. Both backends answer through :class:`MemoryCaps`:
:class:`NvmlCaps` (the real driver, through the library pynvml loaded) and the fake NVML's
(``vgpu.node.fake_memcap``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

LIMIT_MAX = 0xFFFF_FFFF_FFFF_FFFF  # NVML_DEVICE_MEMORY_LIMIT_MAX: no hard limit

# NVML's return codes, by the word CapError carries (nvml.h's nvmlReturn_t)
CODES = {
    2: "invalid-argument",
    3: "not-supported",
    4: "no-permission",
    6: "not-found",
    13: "missing",  # NVML_ERROR_FUNCTION_NOT_FOUND: a driver before r615
}


class CapError(Exception):
    """The driver would not set or read a cgroup's limit; ``code`` is one word of ``CODES`` (or
    ``error-<n>``), ``str()`` says what to do."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Limits:
    """One cgroup's limits on one card as the driver holds them."""

    soft: int
    hard: int  # LIMIT_MAX: none
    used: int = 0  # currentUsed


@runtime_checkable
class MemoryCaps(Protocol):
    """A backend that can ask the driver to cap a cgroup's device memory on a card."""

    def memory_caps(self, uuid: str) -> bool:
        """Whether the driver has the call for this card (False: a driver before r615, a MIG device)."""
        ...

    def set_memory_limits(self, uuid: str, cgroup: str, soft: int, hard: int) -> None:
        """Set (or, with 0 and LIMIT_MAX, clear) the limits; raises CapError."""
        ...

    def get_memory_limits(self, uuid: str, cgroup: str) -> Limits:
        """The limits set now; raises CapError."""
        ...


class _Set(ctypes.Structure):
    _fields_ = [
        ("nameSpace", ctypes.c_char_p),
        ("softLimit", ctypes.c_ulonglong),
        ("hardLimit", ctypes.c_ulonglong),
    ]


class _Get(ctypes.Structure):
    _fields_ = [
        ("nameSpace", ctypes.c_char_p),
        ("softLimit", ctypes.c_ulonglong),
        ("hardLimit", ctypes.c_ulonglong),
        ("currentUsed", ctypes.c_ulonglong),
    ]


def error_of(value: int, what: str) -> CapError:
    code = CODES.get(value, f"error-{value}")
    hint = {
        "missing": "the driver has no nvmlDeviceSetMemoryLimits_v1 (it came with r615)",
        "no-permission": "the node monitor must run as root to set the driver's cap",
        "not-supported": "the driver does not cap this device (a MIG device, or no cgroup v2 device memory)",
        "invalid-argument": "the driver refused the cgroup path or the limits",
        "not-found": "the cgroup is gone",
    }.get(code, f"NVML error {value}")
    return CapError(code, f"{what}: {hint}")


class NvmlCaps:
    """The cap through NVML, as loaded by pynvml (``nv``: the module; ``handles``: uuid -> handle;
    ``mig``: the UUIDs that are MIG devices, never passed to the driver)."""

    def __init__(self, nv: Any, handles: dict[str, Any], mig: frozenset[str] = frozenset()) -> None:
        self._nv = nv
        self._handles = handles
        self._mig = mig
        self._fns: dict[str, Any] = {}

    def _fn(self, name: str) -> Any:
        if name not in self._fns:
            try:
                self._fns[name] = self._nv._nvmlGetFunctionPointer(name)
            except self._nv.NVMLError as err:
                self._fns[name] = None
                if getattr(err, "value", None) != 13:
                    raise error_of(int(getattr(err, "value", -1)), name) from err
        fn = self._fns[name]
        if fn is None:
            raise error_of(13, name)
        return fn

    def memory_caps(self, uuid: str) -> bool:
        if self._is_mig(uuid) or uuid not in self._handles:
            return False
        try:
            self._fn("nvmlDeviceSetMemoryLimits_v1")
        except CapError:
            return False
        return True

    def _is_mig(self, uuid: str) -> bool:
        return uuid in self._mig or uuid.startswith("MIG-")  # NVML refuses MIG handles

    def _handle(self, uuid: str, cgroup: str) -> Any:
        if self._is_mig(uuid):
            raise error_of(3, f"{uuid} {cgroup}")
        try:
            return self._handles[uuid]
        except KeyError:
            raise CapError("invalid-argument", f"{uuid}: no such card on the node") from None

    def set_memory_limits(self, uuid: str, cgroup: str, soft: int, hard: int) -> None:
        handle = self._handle(uuid, cgroup)
        limits = _Set(cgroup.encode(), soft, hard)
        ret = self._fn("nvmlDeviceSetMemoryLimits_v1")(handle, ctypes.byref(limits))
        if ret != 0:
            raise error_of(int(ret), f"setting {uuid}'s limit of {cgroup}")

    def get_memory_limits(self, uuid: str, cgroup: str) -> Limits:
        handle = self._handle(uuid, cgroup)
        limits = _Get(cgroup.encode(), 0, 0, 0)
        ret = self._fn("nvmlDeviceGetMemoryLimits_v1")(handle, ctypes.byref(limits))
        if ret != 0:
            raise error_of(int(ret), f"reading {uuid}'s limit of {cgroup}")
        return Limits(int(limits.softLimit), int(limits.hardLimit), int(limits.currentUsed))
