"""What the plugin needs to know about the node's GPUs, behind one narrow interface.

Two backends satisfy :class:`Discovery`: :class:`vgpu.node.nvml.NvmlDiscovery` (the real cards,
through pynvml) and :class:`vgpu.node.fake_nvml.FakeDiscovery` (cards described by a YAML file,
for tests and the sandbox). The kubelet plumbing, the inventory writer and the monitor only ever
talk to this interface.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Card:
    """One physical GPU as discovered, before the node config scales it."""

    uuid: str
    index: int
    model: str
    memory_mib: int
    numa: int = -1  # -1: unknown
    healthy: bool = True
    links: Mapping[str, str] = field(default_factory=dict)  # peer uuid -> "nvlink" | "pcie" ...
    minor: int = -1  # the driver's minor number (/dev/nvidia<minor>); -1: unknown, the index stands in
    compute_capability: str = ""  # "9.0" (major.minor); "": unknown


@dataclass(frozen=True)
class HealthEvent:
    """A card changed health; ``reason`` says why (``Xid 79``, ``marked unhealthy in gpus.yaml``)."""

    uuid: str
    healthy: bool
    reason: str


@dataclass(frozen=True)
class CardUsage:
    """What the card reports right now, for the monitor."""

    memory_used_mib: int
    memory_total_mib: int
    utilization_percent: int


@dataclass(frozen=True)
class Codec:
    """A process's use of the card's media engines in the driver's latest samples, in percent of
    the sample period: NVDEC (``dec``), NVENC (``enc``) and, where the driver gives them
    (``nvmlDeviceGetProcessesUtilizationInfo``), NVJPG (``jpg``) and the optical-flow engine
    (``ofa``); None: the driver does not say."""

    dec: int = 0
    enc: int = 0
    jpg: int | None = None
    ofa: int | None = None

    def __add__(self, other: Codec) -> Codec:
        """Two processes' use together (a container's); an engine either does not say stays unsaid."""

        def both(a: int | None, b: int | None) -> int | None:
            return None if a is None or b is None else a + b

        return Codec(
            self.dec + other.dec, self.enc + other.enc, both(self.jpg, other.jpg), both(self.ofa, other.ofa)
        )


@dataclass(frozen=True)
class GpuProcess:
    """One process on a card as the driver sees it (the host's view; the hook plays no part)."""

    pid: int  # in the host's PID namespace
    memory_bytes: int  # device memory the driver says it holds, its context included
    sm_percent: int | None = None  # its share of the card's SMs in the driver's latest samples
    codec: Codec | None = None  # its media engines' share in the same samples; None: not sampled
    mps: bool = False  # a client of the card's MPS daemon (NVML's MPS process list), docs/mps.md


@dataclass(frozen=True)
class SmSample:
    """One of the driver's per-process utilization samples (``nvmlDeviceGetProcessUtilization``):
    for ``period_ns`` up to ``end_ns`` (CLOCK_MONOTONIC), a kernel of process ``pid`` (the
    host's PID) ran ``sm_percent`` of the time. GPU time: ``sm_percent / 100 * period_ns``."""

    pid: int
    end_ns: int
    period_ns: int
    sm_percent: int


@runtime_checkable
class SmSource(Protocol):
    """A backend that gives the driver's per-process GPU time samples (the node's compute gate)."""

    def sm_samples(self, uuid: str) -> list[SmSample] | None:
        """The samples of one card taken since the previous call; None when it cannot be read."""
        ...


@runtime_checkable
class ProcessSource(Protocol):
    """A backend that can tell the processes on each card (both of ours can; the fake one only
    with a ``processDir``, which ``lists_processes`` says)."""

    @property
    def lists_processes(self) -> bool: ...

    def processes(self, uuid: str) -> list[GpuProcess] | None:
        """The processes holding memory on one card; None when the card cannot be read now."""
        ...


class Discovery(Protocol):
    def cards(self) -> list[Card]:
        """Every GPU of the node, in index order, with its current health."""
        ...

    def wait_health_events(self, timeout_s: float) -> list[HealthEvent]:
        """Block up to ``timeout_s`` for health changes; returns those seen (maybe none)."""
        ...

    def usage(self, uuid: str) -> CardUsage | None:
        """Current memory and utilization of one card, None when it cannot be read."""
        ...

    def close(self) -> None: ...
