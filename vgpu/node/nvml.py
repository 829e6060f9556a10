"""Discovery of the real GPUs through NVML (pynvml): cards, memory, model, NUMA, NVLink, Xid health,
and each card's processes (``processes``: the node monitor's host view).

Per process the driver gives its device memory (``nvmlDeviceGetComputeRunningProcesses``, which
pynvml calls as ``_v3``; the context's own memory included) and its GPU time as utilization
samples (``nvmlDeviceGetProcessUtilization``: the percent of the sample period a kernel of the
process ran, per sample the driver keeps, about six a second). Accounting stats
(``nvmlDeviceGetAccountingStats``) would need accounting mode turned on by root on every card,
which a plugin should not change, so the samples are used.

``sm_samples`` gives the node's compute gate (``vgpu.monitor.compute``) every sample
once, with its own cursor: the driver samples a card every sixth of a second or so and keeps a
short history; each sample's ``smUtil`` covers the time since the card's previous sample, which
is taken here as the gap between the card's distinct sample times (at most 1.5 times the usual
gap, so a card idle for a while does not make its next sample count for the idle time)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from vgpu.core.errors import ConfigError
from vgpu.node.discovery import Card, CardUsage, Codec, GpuProcess, HealthEvent, SmSample
from vgpu.node.memcap import Limits, NvmlCaps

log = logging.getLogger(__name__)

# Xids caused by the application, not the card (as NVIDIA's own plugin treats them): no health change.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
PERIOD_US = 166_667  # the driver's usual gap between utilization samples, until a card shows its own


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _mean_codec(rows: list[tuple[int, ...]]) -> Codec:
    """A process's media engines over its samples (each row dec, enc and maybe jpg, ofa)."""
    means = [sum(col) // len(rows) for col in zip(*rows, strict=False)]
    return Codec(means[0], means[1], *means[2:4]) if len(means) >= 4 else Codec(means[0], means[1])


class NvmlDiscovery:
    """Discovery through NVML. ``root`` prefixes /sys when NVML cannot tell the NUMA node."""

    def __init__(self, root: Path = Path("/")) -> None:
        import pynvml

        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            raise ConfigError(
                "NVML",
                "",
                f"cannot initialise NVML ({err}); run on a GPU node, or pass --fake-nvml GPUS.yaml",
            ) from err
        self.root = root
        self._lock = threading.Lock()
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self._uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in self._handles]
        self._unhealthy: dict[str, str] = {}
        self._events: Any = None
        try:
            self._events = pynvml.nvmlEventSetCreate()
            for h in self._handles:
                try:
                    pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, self._events)
                except pynvml.NVMLError as err:
                    log.warning("Xid events unavailable on %s (%s); health is not watched", _text(h), err)
        except pynvml.NVMLError as err:
            log.warning("NVML events unavailable (%s); card health is not watched", err)
        self._static = [self._describe(i, h) for i, h in enumerate(self._handles)]
        try:
            self.driver_version = _text(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError:
            self.driver_version = ""
        self._samples_at = [0] * len(self._handles)  # the newest utilization sample seen, per card (us)
        self._sm: list[dict[int, int]] = [{} for _ in self._handles]  # pid -> SM percent, per card
        self._codec: list[dict[int, Codec]] = [{} for _ in self._handles]  # pid -> media engines, per card
        self._info_call = True  # nvmlDeviceGetProcessesUtilizationInfo answers (jpg, ofa too)
        self.caps = NvmlCaps(pynvml, dict(zip(self._uuids, self._handles, strict=True)))
        self._sampled = [0.0] * len(self._handles)  # when the samples were last read (monotonic s)
        self._no_memory_told = False
        self._sm_cursor = [0] * len(self._handles)  # sm_samples: the newest sample time seen (us)
        self._sm_gaps: list[list[int]] = [[] for _ in self._handles]  # the card's recent gaps (us)

    def _numa(self, handle: Any) -> int:
        nv = self._nvml
        try:
            return int(nv.nvmlDeviceGetNumaNodeId(handle))
        except (nv.NVMLError, AttributeError):
            pass
        try:
            bus = _text(nv.nvmlDeviceGetPciInfo(handle).busId).lower()
            # NVML spells the domain with 8 hex digits, sysfs with 4.
            bus = bus[4:] if len(bus.split(":")[0]) == 8 else bus
            value = int((self.root / "sys/bus/pci/devices" / bus / "numa_node").read_text().strip())
            return max(value, -1)
        except (nv.NVMLError, OSError, ValueError):
            return -1

    def _links(self, index: int, handle: Any) -> dict[str, str]:
        nv = self._nvml
        links: dict[str, str] = {}
        for j, peer in enumerate(self._handles):
            if j == index:
                continue
            kind = "pcie"
            try:
                if (
                    nv.nvmlDeviceGetP2PStatus(handle, peer, nv.NVML_P2P_CAPS_INDEX_NVLINK)
                    == nv.NVML_P2P_STATUS_OK
                ):
                    kind = "nvlink"
            except nv.NVMLError:
                pass
            links[self._uuids[j]] = kind
        return links

    def _describe(self, index: int, handle: Any) -> Card:
        nv = self._nvml
        mem = nv.nvmlDeviceGetMemoryInfo(handle)
        return Card(
            uuid=self._uuids[index],
            index=index,
            model=_text(nv.nvmlDeviceGetName(handle)),
            memory_mib=int(mem.total) // (1 << 20),
            numa=self._numa(handle),
            links=self._links(index, handle),
            minor=self._minor(handle),
            compute_capability=self._capability(handle),
        )

    def _capability(self, handle: Any) -> str:
        try:
            major, minor = self._nvml.nvmlDeviceGetCudaComputeCapability(handle)
        except self._nvml.NVMLError:
            return ""
        return f"{int(major)}.{int(minor)}"

    def _minor(self, handle: Any) -> int:
        try:
            return int(self._nvml.nvmlDeviceGetMinorNumber(handle))
        except self._nvml.NVMLError:
            return -1

    def cards(self) -> list[Card]:
        with self._lock:
            return [replace(c, healthy=c.uuid not in self._unhealthy) for c in self._static]

    def usage(self, uuid: str) -> CardUsage | None:
        nv = self._nvml
        try:
            h = self._handles[self._uuids.index(uuid)]
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            try:
                util = int(nv.nvmlDeviceGetUtilizationRates(h).gpu)
            except nv.NVMLError:
                util = 0
            return CardUsage(int(mem.used) // (1 << 20), int(mem.total) // (1 << 20), util)
        except (ValueError, nv.NVMLError):
            return None

    @property
    def lists_processes(self) -> bool:
        return True

    def processes(self, uuid: str) -> list[GpuProcess] | None:
        """The compute processes on one card with their memory and SM share; None when NVML fails."""
        nv = self._nvml
        if uuid.startswith("MIG-"):
            return self._mig_processes(uuid)
        try:
            index = self._uuids.index(uuid)
            listed = nv.nvmlDeviceGetComputeRunningProcesses(self._handles[index])
        except (ValueError, nv.NVMLError):
            return None
        sm = self._utilization(index)
        clients = self._mps_clients(index)
        found: dict[int, int] = {}
        mps: dict[int, int] = {}  # an MPS client's memory, from the MPS list (some drivers list it in both)
        for p, into in [*((p, found) for p in listed), *((p, mps) for p in clients)]:
            used = getattr(p, "usedGpuMemory", None)
            if used is None and not self._no_memory_told:
                # NVML_VALUE_NOT_AVAILABLE: the driver will not say (no permission); counted as 0
                self._no_memory_told = True
                log.warning("NVML does not give per-process memory on %s; memory is not enforced", uuid)
            into[int(p.pid)] = into.get(int(p.pid), 0) + int(used or 0)  # one entry per context
        found.update(mps)
        codec = self._codec[index]
        return [GpuProcess(pid, used, sm.get(pid), codec.get(pid), pid in mps) for pid, used in found.items()]

    def _mps_clients(self, index: int) -> list[Any]:
        """The card's MPS clients (``nvmlDeviceGetMPSComputeRunningProcesses``, v3 in pynvml), which
        the driver lists apart from the other compute processes; none where the driver has no MPS."""
        nv = self._nvml
        try:
            return list(nv.nvmlDeviceGetMPSComputeRunningProcesses(self._handles[index]))
        except (AttributeError, nv.NVMLError):
            return []

    def memory_caps(self, uuid: str) -> bool:
        return self.caps.memory_caps(uuid)

    def set_memory_limits(self, uuid: str, cgroup: str, soft: int, hard: int) -> None:
        self.caps.set_memory_limits(uuid, cgroup, soft, hard)

    def get_memory_limits(self, uuid: str, cgroup: str) -> Limits:
        return self.caps.get_memory_limits(uuid, cgroup)

    def _samples(self, index: int) -> list[Any]:
        """The card's per-process samples since the last read: the newer call where the driver
        has it (NVJPG and OFA too), else the older one (NVDEC and NVENC)."""
        nv = self._nvml
        handle, since = self._handles[index], self._samples_at[index]
        if self._info_call:
            try:
                return list(nv.nvmlDeviceGetProcessesUtilizationInfo(handle, since))
            except (nv.NVMLError_FunctionNotFound, nv.NVMLError_NotSupported, AttributeError):
                self._info_call = False
        return list(nv.nvmlDeviceGetProcessUtilization(handle, since))

    def _mig_processes(self, uuid: str) -> list[GpuProcess] | None:
        """The processes on one MIG device, from NVML on the MIG device's own handle (its memory
        is the slice's; the driver gives no per-process SM samples on a MIG device)."""
        nv = self._nvml
        try:
            listed = nv.nvmlDeviceGetComputeRunningProcesses(nv.nvmlDeviceGetHandleByUUID(uuid))
        except nv.NVMLError:
            return None
        found: dict[int, int] = {}
        for p in listed:
            found[int(p.pid)] = found.get(int(p.pid), 0) + int(getattr(p, "usedGpuMemory", 0) or 0)
        return [GpuProcess(pid, used) for pid, used in found.items()]

    def _utilization(self, index: int, every_s: float = 1.0) -> dict[int, int]:
        """pid -> SM percent from the samples since the last read, read at most every ``every_s``."""
        nv = self._nvml
        now = time.monotonic()
        if now - self._sampled[index] < every_s:
            return self._sm[index]
        self._sampled[index] = now
        try:
            samples = self._samples(index)
        except nv.NVMLError:
            samples = []  # NOT_FOUND: no sample since the last read
        sm: dict[int, list[int]] = {}
        media: dict[int, list[tuple[int, ...]]] = {}
        for s in samples:
            sm.setdefault(int(s.pid), []).append(int(s.smUtil))
            row: tuple[int, ...] = (int(s.decUtil), int(s.encUtil))
            if hasattr(s, "jpgUtil"):
                row += (int(s.jpgUtil), int(s.ofaUtil))
            media.setdefault(int(s.pid), []).append(row)
            self._samples_at[index] = max(self._samples_at[index], int(s.timeStamp))
        self._sm[index] = {pid: sum(v) // len(v) for pid, v in sm.items()}
        self._codec[index] = {pid: _mean_codec(rows) for pid, rows in media.items()}
        return self._sm[index]

    def sm_samples(self, uuid: str) -> list[SmSample] | None:
        """The card's per-process utilization samples since the previous call, oldest first."""
        nv = self._nvml
        try:
            index = self._uuids.index(uuid)
            samples = nv.nvmlDeviceGetProcessUtilization(self._handles[index], self._sm_cursor[index])
        except ValueError:
            return None
        except nv.NVMLError as err:
            if getattr(err, "value", None) == getattr(nv, "NVML_ERROR_NOT_FOUND", -1):
                return []  # no sample since the cursor
            return None
        # the samples' clock is the CPU's in us (the wall clock; the monotonic one where a driver
        # gives that); the gate's is CLOCK_MONOTONIC
        newest = max((int(s.timeStamp) for s in samples), default=0)
        wall = abs(newest * 1000 - time.time_ns()) < abs(newest * 1000 - time.monotonic_ns())
        offset_ns = time.monotonic_ns() - time.time_ns() if wall else 0
        first = self._sm_cursor[index] == 0
        last = self._sm_cursor[index]
        out: list[SmSample] = []
        for stamp in sorted({int(s.timeStamp) for s in samples if int(s.timeStamp) > last}):
            gaps = self._sm_gaps[index]
            # the median gap: idle stretches (no process busy, no sample) do not move it
            usual = sorted(gaps)[len(gaps) // 2] if gaps else PERIOD_US
            gap = stamp - last if last else usual
            if last and 0 < gap < 1_000_000:
                gaps[:] = [*gaps[-15:], gap]
            period_us = min(gap, usual * 3 // 2)
            for s in samples:
                if int(s.timeStamp) == stamp:
                    out.append(
                        SmSample(int(s.pid), stamp * 1000 + offset_ns, period_us * 1000, int(s.smUtil))
                    )
            last = stamp
        self._sm_cursor[index] = last
        return [] if first else out  # the first read only learns the history's gaps: from now on

    def wait_health_events(self, timeout_s: float) -> list[HealthEvent]:
        nv = self._nvml
        if self._events is None:
            threading.Event().wait(timeout_s)
            return []
        try:
            data = nv.nvmlEventSetWait_v2(self._events, int(timeout_s * 1000))
        except nv.NVMLError as err:
            if getattr(err, "value", None) != nv.NVML_ERROR_TIMEOUT:
                log.warning("waiting for NVML events failed: %s", err)
            return []
        xid = int(data.eventData)
        if xid in APPLICATION_XIDS:
            return []
        uuid = _text(nv.nvmlDeviceGetUUID(data.device))
        with self._lock:
            if uuid in self._unhealthy:
                return []
            self._unhealthy[uuid] = f"Xid {xid}"
        return [HealthEvent(uuid, False, f"Xid {xid}")]

    def close(self) -> None:
        nv = self._nvml
        try:
            if self._events is not None:
                nv.nvmlEventSetFree(self._events)
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass
