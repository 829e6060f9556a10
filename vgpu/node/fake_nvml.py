"""A stand-in for NVML: GPUs described by a small YAML file (tests and the sandbox use it).

The file::

    gpus:
      - uuid: GPU-3f1c0d6e-0000-4000-8000-000000000000   # required, unique, at most 58 characters
        model: NVIDIA H200                                # default "Fake GPU"
        memoryMiB: 143771                                 # required, > 0
        index: 0                                          # default: position in the list
        numa: 0                                           # default -1 (unknown)
        healthy: true                                     # default true
        links: {GPU-...: nvlink}                          # default {}
        memoryUsedMiB: 0                                  # what the monitor reports, default 0
        utilization: 0                                    # percent, default 0
        computeCapability: "9.0"                          # major.minor, default unknown
        mig: {mode: enabled, instances: [{profile: 1g.10gb, start: 0}]}   # optional: MIG (below)
        driverMemoryLimits: false                         # the driver caps cgroups (fake_memcap.py)

    driverVersion: 570.124.06                             # optional: the driver's version (DRA attribute)
    processDir: /var/lib/vgpu-stub/procs                  # optional: per-process memory (below)
    migState: /var/lib/vgpu-fake/mig.json                 # optional: MIG state, default <file>.mig.json
    memoryLimitsLog: /tmp/vgpu-caps.jsonl                 # optional: the driver-cap calls (fake_memcap.py)

A card with a ``mig:`` section is in MIG as an H100 80GB or H200 141GB would be (its ``model``
picks the profile table): ``mode`` (enabled, disabled, pending-enable, pending-disable) and the
GPU instances it holds at first start (``{profile, start}``); from then on its instances live in
the ``migState`` file, as a card keeps them across a plugin restart (``vgpu/node/fake_mig.py``).

The file is watched: edit ``healthy`` and the plugin
sees a health event within about a second, as it would see an Xid from NVML.

``processDir`` is where the stub driver (native/hook/stub, ``STUB_CUDA_PROCESS_DIR``) records
each process's device memory, as the real driver keeps it: one file per process, named
``<pid>@<start time>`` (its PID in its own PID namespace and its start time in clock ticks
since boot, ``/proc/<pid>/stat`` field 22), one ``<uuid or index> <bytes>`` line per device,
rewritten on every allocation and free. ``processes(uuid)`` reads them back with the host's
PID of each (the process whose start time and innermost ``NSpid`` match), as NVML's running
processes give them; files of processes that are gone are skipped, as the driver frees a dead
process's memory.

The stub also records each process's GPU time there (``<pid>@<start time>.sm``: per device the
kernel time ever queued and the end of each stream still busy). ``sm_samples(uuid)`` turns it
into what ``nvmlDeviceGetProcessUtilization`` gives: per live process, the percent of the time
since the previous call that its kernels ran (a whole percent, as NVML's ``smUtil``).
A ``<pid>@<start time>.codec`` file beside them gives the process's media-engine samples
(``vgpu.node.fake_codec``), listed with its memory by ``processes(uuid)``.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from vgpu.core.errors import ConfigError
from vgpu.node.discovery import Card, CardUsage, GpuProcess, HealthEvent, SmSample
from vgpu.node.fake_codec import read_codec
from vgpu.node.fake_memcap import FakeCaps, parse_caps
from vgpu.node.fake_mig import FakeMig, parse_mig_sections, parse_state_path
from vgpu.node.memcap import Limits

MAX_UUID_LEN = 58  # device IDs are "<uuid>::<n>" and kubelet allows 63 characters
KEYS = {
    "index",
    "uuid",
    "model",
    "memoryMiB",
    "numa",
    "healthy",
    "links",
    "memoryUsedMiB",
    "utilization",
    "computeCapability",
    "mig",
    "driverMemoryLimits",  # vgpu/node/fake_memcap.py
}
_CAPABILITY = re.compile(r"^[0-9]{1,3}\.[0-9]{1,3}$")
_DRIVER_VERSION = re.compile(r"^[0-9]{1,5}(\.[0-9]{1,5}){1,3}$")


def parse_fake_gpus(text: str, source: str) -> tuple[list[Card], dict[str, CardUsage]]:
    """Parse the fake GPU file; raises ConfigError naming the field."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(source, "", f"not valid YAML ({err})") from err
    if not isinstance(doc, dict) or not isinstance(doc.get("gpus"), list):
        raise ConfigError(source, "gpus", "must be a list of GPUs (see docs/device-plugin.md)")
    cards: list[Card] = []
    usage: dict[str, CardUsage] = {}
    for i, item in enumerate(doc["gpus"]):
        path = f"gpus[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(source, path, "must be a mapping with at least uuid and memoryMiB")
        unknown = sorted(set(item) - KEYS)
        if unknown:
            raise ConfigError(
                source, f"{path}.{unknown[0]}", f"unknown key; known: {', '.join(sorted(KEYS))}"
            )
        uuid = item.get("uuid")
        if not isinstance(uuid, str) or not uuid or len(uuid) > MAX_UUID_LEN:
            raise ConfigError(source, f"{path}.uuid", f"must be a string of 1..{MAX_UUID_LEN} characters")
        if any(c.uuid == uuid for c in cards):
            raise ConfigError(source, f"{path}.uuid", f"duplicate uuid {uuid!r}")
        mem = _int(item, "memoryMiB", path, source, minimum=1, default=None)
        links = item.get("links", {}) or {}
        if not isinstance(links, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in links.items()
        ):
            raise ConfigError(source, f"{path}.links", "must map peer uuid to a link kind (nvlink, pcie)")
        healthy = item.get("healthy", True)
        if not isinstance(healthy, bool):
            raise ConfigError(source, f"{path}.healthy", "must be true or false")
        model = item.get("model", "Fake GPU")
        if not isinstance(model, str):
            raise ConfigError(source, f"{path}.model", "must be a string")
        capability = item.get("computeCapability", "")
        if not isinstance(capability, str) or (capability and not _CAPABILITY.match(capability)):
            raise ConfigError(
                source, f"{path}.computeCapability", f"must be MAJOR.MINOR such as '9.0', got {capability!r}"
            )
        index = _int(item, "index", path, source, minimum=0, default=i)
        if any(c.index == index for c in cards):
            raise ConfigError(source, f"{path}.index", f"duplicate index {index}")
        cards.append(
            Card(
                uuid=uuid,
                index=index,
                model=model,
                memory_mib=mem,
                numa=_int(item, "numa", path, source, minimum=-1, default=-1),
                healthy=healthy,
                links=dict(links),
                compute_capability=capability,
            )
        )
        usage[uuid] = CardUsage(
            memory_used_mib=_int(item, "memoryUsedMiB", path, source, minimum=0, default=0),
            memory_total_mib=mem,
            utilization_percent=_int(item, "utilization", path, source, minimum=0, default=0),
        )
    return sorted(cards, key=lambda c: c.index), usage


def parse_driver_version(text: str, source: str) -> str:
    """The file's optional ``driverVersion`` ("" without one); raises ConfigError naming it."""
    doc = yaml.safe_load(text)
    value = doc.get("driverVersion", "") if isinstance(doc, dict) else ""
    value = str(value) if isinstance(value, float) else value  # 570.86 reads as a number
    if not isinstance(value, str) or (value and not _DRIVER_VERSION.match(value)):
        raise ConfigError(source, "driverVersion", f"must be a version such as 570.124.06, got {value!r}")
    return value


def parse_process_dir(text: str, source: str) -> Path | None:
    """The file's optional ``processDir``; raises ConfigError naming it."""
    doc = yaml.safe_load(text)
    value = doc.get("processDir") if isinstance(doc, dict) else None
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith("/"):
        raise ConfigError(source, "processDir", f"must be an absolute path, got {value!r}")
    return Path(value)


def _int(item: dict[str, Any], key: str, path: str, source: str, minimum: int, default: int | None) -> int:
    value = item.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(source, f"{path}.{key}", f"must be an integer >= {minimum}, got {value!r}")
    return value


def _busy_at(lines: list[str], keys: set[str], now: int) -> int | None:
    """GPU time a stub ``.sm`` file says its process used on a card (``keys``) up to ``now``."""
    for line in lines:
        words = line.split()
        if len(words) < 2 or words[0] not in keys or not all(w.isdigit() for w in words[1:]):
            continue
        return int(words[1]) - sum(max(0, int(end) - now) for end in words[2:])
    return None


class FakeDiscovery:
    """Discovery from a YAML file, re-read when it changes (health, usage)."""

    def __init__(self, path: Path, poll_s: float = 0.5) -> None:
        self.path = Path(path)
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._stamp = self._file_stamp()
        text = self.path.read_text()
        self._cards, self._usage = parse_fake_gpus(text, str(self.path))
        self.process_dir = parse_process_dir(text, str(self.path))
        self.driver_version = parse_driver_version(text, str(self.path))
        capped, caps_log = parse_caps(yaml.safe_load(text), str(self.path))
        self.caps = FakeCaps(capped, caps_log, process_dir=self.process_dir)  # the driver's cap
        self.proc = Path("/proc")
        self._host_pids: dict[str, int] = {}  # a process file's name -> the host's PID of it
        self._gone: set[str] = set()  # files of processes found gone: never looked up again
        self._sm_seen: dict[tuple[str, str], tuple[int, int]] = {}  # (file, card) -> (ns, busy ns) last read
        doc = yaml.safe_load(text)
        specs = parse_mig_sections(doc, self._cards, str(self.path))
        # MIG (fake_mig.py): only where a card has a ``mig:`` section
        self.mig: FakeMig | None = (
            FakeMig(self._cards, specs, parse_state_path(doc, self.path, str(self.path)), self.processes)
            if specs
            else None
        )

    def _file_stamp(self) -> tuple[int, int, int]:
        st = self.path.stat()
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def cards(self) -> list[Card]:
        with self._lock:
            return list(self._cards)

    def usage(self, uuid: str) -> CardUsage | None:
        with self._lock:
            return self._usage.get(uuid)

    @property
    def lists_processes(self) -> bool:
        """Only with a ``processDir``: without one no process is ever listed, so the node
        monitor runs no enforcer (the sandbox's simulated nodes)."""
        return self.process_dir is not None

    def processes(self, uuid: str) -> list[GpuProcess] | None:
        """What the stub driver's processes hold on one card (``processDir``), by host PID."""
        files = self._process_files(uuid, "")
        if files is None:
            return None
        keys, rows = files
        found: list[GpuProcess] = []
        for stem, pid, lines in rows:
            held = 0
            mps = False
            for line in lines:
                key, _, value = line.partition(" ")
                if key in keys and value.strip().isdigit():
                    held += int(value)
                mps = mps or (key == "mps" and value.strip() == "1")  # the stub's MPS client
            if held:
                assert self.process_dir is not None  # files came from it
                codec = read_codec(self.process_dir / f"{stem}.codec", keys)
                found.append(GpuProcess(pid, held, codec=codec, mps=mps))
        return found

    def mps_processes(self, uuid: str) -> list[GpuProcess]:
        """``nvmlDeviceGetMPSComputeRunningProcesses``: the card's MPS clients only."""
        return [p for p in self.processes(uuid) or [] if p.mps]

    def compute_processes(self, uuid: str) -> list[GpuProcess]:
        """``nvmlDeviceGetComputeRunningProcesses``: every process of the card, its MPS clients too
        (driver 580 on an H100 lists the MPS server, each client and each plain process there)."""
        return list(self.processes(uuid) or [])

    def memory_caps(self, uuid: str) -> bool:
        return self.caps.memory_caps(uuid)

    def set_memory_limits(self, uuid: str, cgroup: str, soft: int, hard: int) -> None:
        self.caps.set_memory_limits(uuid, cgroup, soft, hard)

    def get_memory_limits(self, uuid: str, cgroup: str) -> Limits:
        return self.caps.get_memory_limits(uuid, cgroup)

    def sm_samples(self, uuid: str) -> list[SmSample] | None:
        """One sample per live process with GPU time recorded on the card: its share of the time
        since the previous call (the first call for a process only sets where it starts)."""
        files = self._process_files(uuid, ".sm")
        if files is None:
            return None
        keys, rows = files
        found: list[SmSample] = []
        seen: dict[tuple[str, str], tuple[int, int]] = {}
        for stem, pid, lines in rows:
            now = time.monotonic_ns()  # CLOCK_MONOTONIC, the stub's clock
            busy = _busy_at(lines, keys, now)
            if busy is None:
                continue
            key = (stem, uuid)
            seen[key] = (now, busy)
            before = self._sm_seen.get(key)
            if before is None or now <= before[0]:
                continue
            period = now - before[0]
            percent = round(100 * max(0, busy - before[1]) / period)
            found.append(SmSample(pid, now, period, min(100, percent)))
        self._sm_seen = {k: v for k, v in self._sm_seen.items() if k[1] != uuid} | seen
        return found

    def _process_files(
        self, uuid: str, suffix: str
    ) -> tuple[set[str], list[tuple[str, int, list[str]]]] | None:
        """The words that name the card in the stub driver's files, and those files of live
        processes named ``<pid>@<start><suffix>`` in ``processDir``: (the name less ``suffix``, host
        PID, lines). None for a card not on the list; nothing without a ``processDir``."""
        if self.process_dir is None:
            return set(), []
        card = next((c for c in self._cards if c.uuid == uuid), None)
        if card is None and not (uuid.startswith("MIG-") and self.mig is not None):
            return None
        keys = {uuid, str(card.index)} if card is not None else {uuid}  # a MIG device: by its uuid
        try:
            names = os.listdir(self.process_dir)
        except OSError:
            return keys, []
        self._gone.intersection_update(n.removesuffix(".sm") for n in names)
        found: list[tuple[str, int, list[str]]] = []
        for name in names:
            if not name.endswith(suffix):
                continue
            stem = name[: len(name) - len(suffix)]
            if stem in self._gone:
                continue
            pid = self._host_pid(stem)  # None for other files: a ".tmp" or, with no suffix, a ".sm"
            if pid is None:
                continue
            try:
                lines = (self.process_dir / name).read_text().splitlines()
            except OSError:
                continue
            found.append((stem, pid, lines))
        return keys, found

    def _host_pid(self, name: str) -> int | None:
        """The host's PID of the live process a file is named after; None when it is gone."""
        own, _, started = name.partition("@")
        if not own.isdigit() or not started.isdigit():
            return None
        cached = self._host_pids.get(name)
        if cached is not None and self._matches(cached, int(own), int(started)):
            return cached
        self._host_pids.pop(name, None)
        for entry in os.listdir(self.proc):
            if entry.isdigit() and self._matches(int(entry), int(own), int(started)):
                self._host_pids[name] = int(entry)
                return int(entry)
        self._gone.add(name)  # the file is its process's own: once it is not found, it is gone
        return None

    def _matches(self, pid: int, own: int, started: int) -> bool:
        try:
            stat = (self.proc / str(pid) / "stat").read_text()
            if int(stat[stat.rindex(")") + 2 :].split()[19]) != started:
                return False
            status = (self.proc / str(pid) / "status").read_text()
        except (OSError, ValueError, IndexError):
            return False
        for line in status.splitlines():
            if line.startswith("NSpid:"):
                return line.split()[-1] == str(own)
        return pid == own  # a kernel without NSpid: no PID namespaces to tell apart

    def _reload(self) -> list[HealthEvent]:
        try:
            stamp = self._file_stamp()
            if stamp == self._stamp:
                return []
            cards, usage = parse_fake_gpus(self.path.read_text(), str(self.path))
        except (OSError, ConfigError):
            return []  # a half-written or broken edit: keep the last good view
        with self._lock:
            before = {c.uuid: c.healthy for c in self._cards}
            self._stamp = stamp
            # The set of cards is fixed at start, as with NVML; only health and usage change.
            by_uuid = {c.uuid: c for c in cards}
            self._cards = [by_uuid.get(c.uuid, c) for c in self._cards]
            self._usage.update({u: v for u, v in usage.items() if u in before})
            return [
                HealthEvent(
                    c.uuid, c.healthy, f"marked {'healthy' if c.healthy else 'unhealthy'} in {self.path}"
                )
                for c in self._cards
                if before[c.uuid] != c.healthy
            ]

    def wait_health_events(self, timeout_s: float) -> list[HealthEvent]:
        deadline = time.monotonic() + timeout_s
        while True:
            events = self._reload()
            left = deadline - time.monotonic()
            if events or left <= 0:
                return events
            time.sleep(min(self.poll_s, left))

    def close(self) -> None:
        pass
