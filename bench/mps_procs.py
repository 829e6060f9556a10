"""bench_mps.py's processes: the MPS control daemon it starts and stops, and the tenants it talks to."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any


class BenchError(Exception):
    """A tenant or the daemon failed; the message says which and how (with the tail of its log)."""


@dataclass
class Daemon:
    control: str
    env: dict[str, str]
    pipe: Path
    pid: int = 0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def start_daemon(binary: str, env: dict[str, str]) -> Daemon:
    """`nvidia-cuda-mps-control -d` with `env` (CUDA_VISIBLE_DEVICES, CUDA_MPS_PIPE_DIRECTORY and
    CUDA_MPS_LOG_DIRECTORY name the card and its folders); back once it listens on <pipe>/control."""
    pipe, log = Path(env["CUDA_MPS_PIPE_DIRECTORY"]), Path(env["CUDA_MPS_LOG_DIRECTORY"])
    pipe.mkdir(parents=True, exist_ok=True)
    log.mkdir(parents=True, exist_ok=True)
    daemon = Daemon(binary, env, pipe)
    # the daemon forks and keeps what it inherits: its output goes to a file, never to a pipe we wait on
    with open(log / "start.out", "w") as out:
        try:
            done = subprocess.run([binary, "-d"], env=env, stdout=out, stderr=out, timeout=30)
        except (OSError, subprocess.SubprocessError) as err:
            raise BenchError(f"{binary} -d did not run: {err} (--mps-control names the binary)") from err
    if done.returncode != 0:
        raise BenchError(f"{binary} -d failed ({done.returncode}): {tail(log / 'start.out', 400)}")
    deadline = time.monotonic() + 15
    pid_file = pipe / "nvidia-cuda-mps-control.pid"
    while time.monotonic() < deadline and not ((pipe / "control").exists() and pid_file.exists()):
        time.sleep(0.05)
    if pid_file.exists():
        daemon.pid = next(iter(numbers(pid_file.read_text())), 0)
    if not (pipe / "control").exists():
        stop_daemon(daemon)
        raise BenchError(
            f"the MPS daemon made no {pipe / 'control'} in 15 s; its log: {tail(log / 'control.log')}"
        )
    return daemon


def control(daemon: Daemon, line: str) -> str:
    """One command to the daemon as `echo LINE | nvidia-cuda-mps-control` with its environment."""
    done = subprocess.run(
        [daemon.control], input=line + "\n", env=daemon.env, capture_output=True, text=True, timeout=15
    )
    return done.stdout


def numbers(text: str) -> list[int]:
    return [int(w) for w in text.split() if w.isdigit()]


def mps_clients(daemon: Daemon) -> set[int]:
    """The PIDs the daemon's servers serve (empty where it cannot say)."""
    try:
        return {
            c
            for s in numbers(control(daemon, "get_server_list"))
            for c in numbers(control(daemon, f"get_client_list {s}"))
        }
    except (OSError, subprocess.SubprocessError):
        return set()


def stop_daemon(daemon: Daemon, grace: float = 10.0) -> None:
    """`quit`, then what is still up of the daemon and its servers after `grace` s is killed (the bench's)."""
    servers: list[int] = []
    try:
        servers = numbers(control(daemon, "get_server_list"))
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        control(daemon, "quit")
    except (OSError, subprocess.SubprocessError) as err:
        print(f"bench_mps: quit to the MPS daemon failed ({err})", file=sys.stderr)
    ours = [p for p in (daemon.pid, *servers) if p > 0]
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(p) for p in ours):
        time.sleep(0.05)
    for pid in ours:
        if alive(pid):
            print(f"bench_mps: MPS process {pid} still up {grace:.0f} s after quit: killed", file=sys.stderr)
            os.kill(pid, signal.SIGKILL)


def tail(path: Path, chars: int = 800) -> str:
    try:
        return path.read_text(errors="replace")[-chars:].strip()
    except OSError:
        return "(none)"


class Worker:
    """One tenant process: JSON lines in and out, its stderr in a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log_path = name, log
        self.log: IO[str] = open(log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
        )
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict):
                self.lines.put(message)
        self.lines.put({"error": f"the process ended ({self.proc.wait()})"})

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except OSError as err:
            raise BenchError(f"tenant {self.name}: {err}; its stderr: {tail(self.log_path)}") from err

    def receive(self, timeout: float) -> dict[str, Any]:
        try:
            message = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise BenchError(
                f"tenant {self.name}: no answer in {timeout:.0f} s; stderr: {tail(self.log_path)}"
            ) from None
        if "error" in message:
            raise BenchError(f"tenant {self.name}: {message['error']}; stderr: {tail(self.log_path)}")
        return message

    def close(self, grace: float = 15.0) -> None:
        """Quit, then kill it if it is still up after `grace` s (a run it is in ends first)."""
        try:
            self.send({"cmd": "quit"})
        except BenchError:
            pass
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
