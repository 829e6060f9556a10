"""Builds native/hook and runs its C test programs under libvgpu over the stub driver."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOOK_DIR = ROOT / "native" / "hook"
BUILD = HOOK_DIR / "build"
STUB_MIB = 8192


@dataclass(frozen=True)
class Built:
    lib: Path
    stub_dir: Path
    tests: Path

    def prog(self, name: str) -> str:
        return str(self.tests / name)


def build() -> Built:
    # One make at a time: pytest-xdist workers (make test) each build beside the others' tests.
    BUILD.mkdir(exist_ok=True)
    with (BUILD / ".tests-build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run(["make", "-s", "-C", str(HOOK_DIR)], check=True, capture_output=True, timeout=300)
    return Built(BUILD / "libvgpu.so", BUILD / "stub", BUILD / "tests")


def env(built: Built, hook: bool = True, **extra: str) -> dict[str, str]:
    out = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LD_LIBRARY_PATH": str(built.stub_dir),
        "STUB_CUDA_MEMORY_MIB": str(STUB_MIB),
        "VGPU_CONTEXT_RESERVE": "0",  # the stub's contexts cost nothing; one test sets it
    }
    if hook:
        out["LD_PRELOAD"] = str(built.lib)
    out.update(extra)
    return out


@dataclass
class Result:
    values: dict[str, str]
    lines: list[str]
    stderr: str
    returncode: int

    def int(self, key: str) -> int:
        return int(self.values[key])


def parse(stdout: str) -> tuple[dict[str, str], list[str]]:
    values: dict[str, str] = {}
    lines = stdout.splitlines()
    for line in lines:
        key, sep, value = line.partition("=")
        if sep:
            values[key] = value
    return values, lines


def run(built: Built, prog: str, *args: str, environ: dict[str, str], timeout: float = 30) -> Result:
    proc = subprocess.run(
        [built.prog(prog), *args], env=environ, capture_output=True, text=True, timeout=timeout, check=False
    )
    values, lines = parse(proc.stdout)
    return Result(values, lines, proc.stderr, proc.returncode)


class Holder:
    """A process holding device memory (and optionally the region lock) until released."""

    def __init__(self, built: Built, mib: int, environ: dict[str, str], lock: bool = False) -> None:
        args = [built.prog("t_hold"), str(mib)] + (["lock"] if lock else [])
        self.proc = subprocess.Popen(
            args,
            env=environ,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.held = self.proc.stdout.readline().strip()
        self.locked = self.proc.stdout.readline().strip() if lock else ""

    def __enter__(self) -> Holder:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.release()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def release(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=10)

    def kill(self, wait: bool = True) -> None:
        """SIGKILL; without wait, returns once the process is a zombie (dead, not yet waited
        for): the signal is delivered asynchronously, and on a loaded machine a test that went on
        at once could find the victim still running."""
        self.proc.kill()
        if wait:
            self.proc.wait(timeout=10)
            return
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                state = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                return
            if state in ("Z", "X"):
                return
            time.sleep(0.005)
        raise AssertionError(f"process {self.proc.pid} still running 10 s after SIGKILL")


class MpsPipe:
    """An MPS pipe folder whose ``control`` socket takes connections, as a running MPS control
    daemon's does (what the hook and the stub driver ask at cuInit). Made under /tmp: a unix
    socket's path is at most 107 bytes. ``stop()`` closes and removes the socket (the daemon gone);
    ``stale()`` leaves its file behind, refusing connections (the daemon died)."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="mps", dir="/tmp"))
        self.sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(self.path / "control"))
        self.sock.listen(128)

    def __enter__(self) -> MpsPipe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.path, ignore_errors=True)

    def stale(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def stop(self) -> None:
        self.stale()
        (self.path / "control").unlink(missing_ok=True)


def process_file(folder: Path) -> dict[str, int]:
    """The one process file the stub driver wrote in its STUB_CUDA_PROCESS_DIR ``folder``:
    ``{"<device>": bytes, "mps": 1, "mps_threads": pct, "mps_pinned": bytes}``."""
    files = [p for p in folder.iterdir() if "@" in p.name and "." not in p.name]
    assert len(files) == 1, files
    return {k: int(v) for k, v in (line.split() for line in files[0].read_text().splitlines())}
