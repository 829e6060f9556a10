"""Starting and stopping the sandbox's processes so that none is ever left behind.

Every process gets its own session (so its children die with it) and carries the
variable ``VGPU_SANDBOX=<state dir>`` in its environment. ``down`` kills the process
groups recorded in the state file and then sweeps ``/proc`` for anything still carrying
the tag, so a crash of any component, or of ``up`` itself, leaves nothing running.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vgpu_sandbox.errors import SandboxError

TAG = "VGPU_SANDBOX"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port_free(port: int, what: str, flag: str, host: str = "127.0.0.1") -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            if err.errno in (errno.EADDRINUSE, errno.EACCES):
                raise SandboxError(
                    f"port {port} on {host} for {what} is already in use; "
                    f"free it, or pick another with {flag} (0 picks a free port)"
                ) from err
            raise


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def start(
    name: str,
    argv: Sequence[str],
    *,
    state_dir: Path,
    log_dir: Path,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    log_dir.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env[TAG] = str(state_dir)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    with open(log_dir / f"{name}.log", "ab") as log:
        try:
            return subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as err:
            raise SandboxError(f"could not start {name} ({argv[0]}): {err}") from err


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def tagged_pids(state_dir: Path) -> list[int]:
    """Processes whose environment carries this sandbox's tag."""
    want = f"{TAG}={state_dir}".encode()
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def stop_group(proc: subprocess.Popen[Any], grace: float = 30.0) -> None:
    """Stop a child started in its own session: SIGTERM to its group, ``grace`` seconds, SIGKILL."""
    if proc.poll() is not None:
        return
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()


def stop_all(pids: Iterable[int], state_dir: Path | None, grace: float = 5.0) -> None:
    """SIGTERM, a grace period, then SIGKILL; the /proc sweep of ``state_dir``'s tag catches strays
    (``None``: only ``pids`` and their groups, as for the real node's daemons and shims)."""

    def tagged() -> set[int]:
        return set(tagged_pids(state_dir)) if state_dir is not None else set()

    targets = set(pids) | tagged()
    for pid in targets:
        _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        targets = {p for p in targets | tagged() if alive(p)}
        if not targets:
            return
        time.sleep(0.1)
    for pid in targets:
        _signal_group(pid, signal.SIGKILL)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        left = [p for p in tagged() if alive(p)]
        if not left:
            return
        for pid in left:
            _signal_group(pid, signal.SIGKILL)
        time.sleep(0.1)
    left = [p for p in tagged() if alive(p)]
    if left:
        raise SandboxError(f"processes {left} of the sandbox would not die; kill them by hand (kill -9)")
