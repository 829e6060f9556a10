"""MPS mode (docs/mps.md): one MPS control daemon per MPS card, run by the node agent.

Each card of a ``sharingMode: mps`` node gets ``nvidia-cuda-mps-control -d`` with
``CUDA_VISIBLE_DEVICES=<uuid>``, ``CUDA_MPS_PIPE_DIRECTORY=<HostPaths.mps_pipe(uuid)>`` and
``CUDA_MPS_LOG_DIRECTORY=<HostPaths.mps_log(uuid)>``; the pipe folder is mounted read-only into the
card's containers (vgpu/deviceplugin/answer.py), whose processes become the daemon's clients.

A daemon is up when its ``control`` socket in the pipe folder accepts a connection, and stays up
while the process its pid file names runs: a live one is adopted at start (the plugin restarted,
the daemon did not), a dead one is started again and counted as a restart. Each card's server
ceilings follow the largest MPS grant on it (:meth:`MpsDaemons.hold`). The DRA plugin runs the
same class for its MPS cards.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from vgpu.hookabi.grant import GRANT_SUFFIX, GrantError, read_grant
from vgpu.hookabi.layout import SHARING_MPS
from vgpu.node.driver import BIN_DIRS
from vgpu.node.paths import HostPaths

log = logging.getLogger(__name__)

CONTROL_BINARY = "nvidia-cuda-mps-control"
CONTROL_SOCKET = "control"  # the daemon's unix socket in its pipe folder
PID_FILE = "nvidia-cuda-mps-control.pid"
SOCKET_PATH_MAX = 107  # sockaddr_un's sun_path, less its NUL
START_WAIT_S = 5.0  # how long a started daemon has to open its control socket


def accepts(pipe: Path, timeout_s: float = 1.0) -> bool:
    """Whether ``pipe``/control accepts a connection (the daemon is up and listening).

    The socket's type is the daemon's to choose: driver 580's control socket is not a stream (a
    stream connect fails with EPROTOTYPE), the fake's is; each type is tried in turn."""
    path = str(pipe / CONTROL_SOCKET)
    for kind in (socket.SOCK_SEQPACKET, socket.SOCK_STREAM, socket.SOCK_DGRAM):
        s = socket.socket(socket.AF_UNIX, kind)
        s.settimeout(timeout_s)
        try:
            s.connect(path)
            return True
        except OSError as err:
            if err.errno != errno.EPROTOTYPE:
                return False
        finally:
            s.close()
    return False


class MpsDaemons:
    """The MPS control daemons of ``uuids``: started, adopted, watched and restarted."""

    def __init__(self, paths: HostPaths, control_binary: str, uuids: Sequence[str]) -> None:
        self.paths = paths
        self.control_binary = control_binary
        self.uuids = list(dict.fromkeys(uuids))
        self._up: dict[str, bool] = {}
        self.restarts: dict[str, int] = dict.fromkeys(self.uuids, 0)
        self._died: set[str] = set()  # found dead, not yet running again
        self.errors: dict[str, str] = {}  # why a card's daemon is down (logged once per change)
        self.ceilings: dict[str, tuple[int, int]] = {}  # per card: (threads %, pinned MiB) as set
        # where the driver's libraries are when the tool is the host's, run from the driver root in
        # the plugin's pod (driverInject plugin or cdi): the daemon and its server load libcuda
        self.library_dirs: list[str] = []

    def env(self, uuid: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
        folder = os.path.dirname(self.control_binary)
        if folder:  # the daemon starts nvidia-cuda-mps-server, found beside it
            env["PATH"] = os.pathsep.join(p for p in (folder, env.get("PATH", "")) if p)
        if self.library_dirs:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                [*self.library_dirs, env.get("LD_LIBRARY_PATH", "")]
            ).rstrip(os.pathsep)
        env.update(
            CUDA_VISIBLE_DEVICES=uuid,
            CUDA_MPS_PIPE_DIRECTORY=str(self.paths.mps_pipe(uuid)),
            CUDA_MPS_LOG_DIRECTORY=str(self.paths.mps_log(uuid)),
        )
        return env

    def _folders(self, uuid: str) -> None:
        p = self.paths
        for folder in (p.mps_dir, p.mps_dir / uuid, p.mps_pipe(uuid), p.mps_log(uuid)):
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o755)  # containers of any user reach the pipe (mounted read-only)

    def _start(self, uuid: str) -> str | None:
        """Start the card's daemon; None when its socket opened, else why not (with the fix)."""
        # the daemon's stderr goes to a file, not a pipe: a daemon that kept a pipe open would
        # hold this call until its time-out
        said = self.paths.mps_log(uuid) / "start.err"
        socket_path = self.paths.mps_pipe(uuid) / CONTROL_SOCKET
        if len(str(socket_path).encode()) > SOCKET_PATH_MAX:
            return (
                f"its control socket {socket_path} would be longer than a unix socket path may be "
                f"({SOCKET_PATH_MAX} bytes): give the plugin a shorter --root"
            )
        try:
            self._folders(uuid)
            with open(said, "wb") as err_file:
                done = subprocess.run(
                    [self.control_binary, "-d"],
                    env=self.env(uuid),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err_file,
                    timeout=START_WAIT_S,
                    check=False,
                )
        except (OSError, subprocess.SubprocessError) as err:
            return f"cannot run {self.control_binary} -d ({err})"
        if done.returncode != 0:
            try:
                text = said.read_text(errors="replace").strip()[-300:]
            except OSError:
                text = ""
            return f"{self.control_binary} -d exited {done.returncode}: {text or 'no message'}"
        deadline = time.monotonic() + START_WAIT_S
        pipe = self.paths.mps_pipe(uuid)
        while time.monotonic() < deadline:
            if accepts(pipe):
                return None
            time.sleep(0.05)
        return f"{self.control_binary} -d started but {pipe / CONTROL_SOCKET} accepts no connection"

    def _running(self, uuid: str) -> bool:
        """Whether the card's daemon runs: the process its pid file names is alive and an MPS
        control (its command line says so) and its socket is there, once it was seen to answer;
        else whether the socket answers. The daemon logs every connection ("User did not send
        valid credentials"), so a check every 2 s by connecting would fill its log."""
        pipe = self.paths.mps_pipe(uuid)
        if self._up.get(uuid):
            try:
                pid = int((pipe / PID_FILE).read_text().strip())
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except (OSError, ValueError):
                return accepts(pipe)
            return b"mps" in cmdline and (pipe / CONTROL_SOCKET).exists()
        return accepts(pipe)

    def ensure(self) -> dict[str, bool]:
        """Start each card's daemon that is not up (adopting a live one); returns up by card."""
        for uuid in self.uuids:
            if self._running(uuid):
                if uuid not in self._up:
                    log.info("MPS daemon of card %s is already running: adopted", uuid)
                elif not self._up[uuid]:
                    log.info("MPS daemon of card %s is up again", uuid)
                self._up[uuid] = True
                self.errors.pop(uuid, None)
                continue
            was = self._up.get(uuid)
            if was:
                self._died.add(uuid)
                log.warning("MPS daemon of card %s died: starting it again", uuid)
            problem = self._start(uuid)
            if problem is None:
                if uuid in self._died:  # counted once it runs again
                    self._died.discard(uuid)
                    self.restarts[uuid] += 1
                log.info("MPS daemon of card %s started (pipe %s)", uuid, self.paths.mps_pipe(uuid))
                self.ceilings.pop(uuid, None)  # a new daemon: its ceilings are set again
                self.errors.pop(uuid, None)
                self._up[uuid] = True
                continue
            if self.errors.get(uuid) != problem:
                log.error(
                    "MPS daemon of card %s cannot start: %s. The card is reported unhealthy until it runs "
                    "(its MPS pods would wait at cuInit). Fix: install the NVIDIA driver's %s on the node "
                    "where the driver root has its tools (chart: driver.root), read its log in %s, or set "
                    "sharingMode: timeslice for the node (docs/mps.md)",
                    uuid,
                    problem,
                    CONTROL_BINARY,
                    self.paths.mps_log(uuid),
                )
            self.errors[uuid] = problem
            self._up[uuid] = False
        return dict(self._up)

    def ask(self, uuid: str, command: str) -> str:
        """One command to the card's daemon through the tool (``echo CMD | nvidia-cuda-mps-control``
        with the card's pipe); its answer, stripped."""
        done = subprocess.run(
            [self.control_binary],
            input=command.encode() + b"\n",
            env=self.env(uuid),
            capture_output=True,
            timeout=START_WAIT_S,
            check=False,
        )
        return done.stdout.decode(errors="replace").strip()

    def hold(self, uuid: str, threads: int, pinned_mib: int, *, only_up: bool = False) -> None:
        """Set the card's server ceilings: the active thread percentage and the pinned device
        memory that a client gets when it sets none itself (a client's own variables only lower
        them). ``threads`` 0 means 100; ``pinned_mib`` 0 leaves the pinned default alone. The hook
        sets each client's own limits from its grant; these bound a client that never loads it (a
        static binary) to the largest grant on the card. ``only_up``: only raise what is set (at
        Allocate, before the new container's first client connects)."""
        threads = threads or 100
        old = self.ceilings.get(uuid)
        if only_up and old is not None:
            threads, pinned_mib = max(threads, old[0]), max(pinned_mib, old[1])
        if old == (threads, pinned_mib) or not self._up.get(uuid):
            return
        commands = [f"set_default_active_thread_percentage {threads}"]
        if pinned_mib:
            commands.append(f"set_default_device_pinned_mem_limit 0 {pinned_mib}M")
        try:
            servers = [w for w in self.ask(uuid, "get_server_list").split() if w.isdigit()]
            for pid in servers:  # a running server keeps the defaults it started with
                commands.append(f"set_active_thread_percentage {pid} {threads}")
                if pinned_mib:
                    commands.append(f"set_device_pinned_mem_limit {pid} 0 {pinned_mib}M")
            said = [self.ask(uuid, c) for c in commands]
        except (OSError, subprocess.SubprocessError) as err:
            log.warning("cannot set the MPS ceilings of card %s: %s", uuid, err)
            return
        refused = [
            f"{c}: {a}"
            for c, a in zip(commands, said, strict=True)
            if a.lower().startswith(("inval", "unrec"))
        ]
        if refused:
            log.warning("MPS daemon of card %s refused: %s", uuid, "; ".join(refused))
            return
        self.ceilings[uuid] = (threads, pinned_mib)
        log.info(
            "MPS ceilings of card %s: %d %% of the threads, %s",
            uuid,
            threads,
            f"{pinned_mib} MiB" if pinned_mib else "memory unset",
        )

    def hold_grants(self, *, only_up: bool = False) -> None:
        """Each card's ceilings from the grants on the node (:func:`grant_ceilings`)."""
        found = grant_ceilings(self.paths, self.uuids)
        for uuid in self.uuids:
            threads, pinned = found.get(uuid, (0, 0))
            self.hold(uuid, threads, pinned, only_up=only_up)

    def up(self, uuid: str) -> bool:
        """Whether the card's daemon was up at the last ``ensure``."""
        return self._up.get(uuid, False)

    def stop(self) -> None:
        """Quit each card's daemon (``echo quit | nvidia-cuda-mps-control`` with its environment)."""
        for uuid in self.uuids:
            pipe = self.paths.mps_pipe(uuid)
            if not accepts(pipe):
                continue
            try:
                self.ask(uuid, "quit")
            except (OSError, subprocess.SubprocessError) as err:
                log.warning("cannot quit the MPS daemon of card %s: %s", uuid, err)
                continue
            deadline = time.monotonic() + START_WAIT_S
            while time.monotonic() < deadline and accepts(pipe, 0.2):
                time.sleep(0.05)
            self._up[uuid] = False


def grant_ceilings(paths: HostPaths, uuids: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Per MPS card, the largest thread percentage (100 for a grant without one) and the largest
    memory limit in MiB (0 where a grant has none: no pinned ceiling) of the MPS grants on it; a
    grant of a container that left counts until the plugin sweeps it (a ceiling too high, never
    one below a live grant)."""
    out: dict[str, tuple[int, int]] = {}
    unlimited: set[str] = set()
    try:
        files = sorted(paths.grants_dir.glob(f"*{GRANT_SUFFIX}"))
    except OSError:
        return out
    for path in files:
        try:
            grant = read_grant(path)
        except GrantError:
            continue
        if grant.sharing != SHARING_MPS:
            continue
        for i, uuid in enumerate(grant.uuids):
            if uuid not in uuids:
                continue
            threads, mib = out.get(uuid, (0, 0))
            limit = grant.value("limit", i)
            if limit == 0:
                unlimited.add(uuid)
            out[uuid] = (max(threads, grant.value("sm_limit", i) or 100), max(mib, -(-limit // (1 << 20))))
    return {u: (t, 0 if u in unlimited else m) for u, (t, m) in out.items()}


def find_control(driver_root: Path) -> Path | None:
    """``nvidia-cuda-mps-control`` where the driver's tools are (vgpu/node/driver.py's folders)."""
    for folder in BIN_DIRS:
        candidate = driver_root / folder / CONTROL_BINARY
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


class MpsCollector(Collector):
    """``vgpu_mps_daemon_up{uuid}`` and ``vgpu_mps_daemon_restarts_total{uuid}``."""

    def __init__(self, node: str, daemons: MpsDaemons) -> None:
        self.node = node
        self.daemons = daemons

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        return iter(())

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        up = GaugeMetricFamily(
            "vgpu_mps_daemon_up",
            "1 while the card's MPS control daemon accepts connections (docs/mps.md)",
            labels=["node", "uuid"],
        )
        restarts = CounterMetricFamily(
            "vgpu_mps_daemon_restarts",
            "Times the card's MPS control daemon was found dead and started again",
            labels=["node", "uuid"],
        )
        for uuid in self.daemons.uuids:
            up.add_metric([self.node, uuid], 1.0 if self.daemons.up(uuid) else 0.0)
            restarts.add_metric([self.node, uuid], float(self.daemons.restarts.get(uuid, 0)))
        yield up
        yield restarts
