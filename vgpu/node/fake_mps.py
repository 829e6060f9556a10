"""A stand-in for ``nvidia-cuda-mps-control`` where no driver is (CI, the sandbox): docs/mps.md.

``python -m vgpu.node.fake_mps -d`` (daemonizes) or ``-f`` (foreground) runs the control daemon:
it writes ``nvidia-cuda-mps-control.pid`` into ``$CUDA_MPS_PIPE_DIRECTORY`` (default
``/tmp/nvidia-mps``), logs to ``$CUDA_MPS_LOG_DIRECTORY/control.log`` (default
``/var/log/nvidia-mps``) and listens on the unix socket ``control`` in the pipe folder, where it
answers newline-terminated commands: ``get_server_list``, ``set_default_active_thread_percentage
N``, ``get_default_active_thread_percentage`` and ``quit``. Without a flag it is the client, as
the real tool is: each line of stdin goes to the daemon and its answer to stdout
(``echo quit | nvidia-cuda-mps-control``). The stub driver (native/hook/stub) takes a process whose
cuInit finds that socket accepting for an MPS client.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

PID_FILE = "nvidia-cuda-mps-control.pid"
CONTROL_SOCKET = "control"


def _dirs() -> tuple[Path, Path]:
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps")
    logs = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY") or "/var/log/nvidia-mps")
    return pipe, logs


class _Daemon:
    def __init__(self, pipe: Path, logs: Path) -> None:
        self.pipe = pipe
        self.logs = logs
        self.threads = 100.0
        self.pinned: dict[str, str] = {}  # device -> the default pinned limit as set ("8000M")

    def log(self, line: str) -> None:
        with open(self.logs / "control.log", "a") as f:
            f.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {line}\n")

    def answer(self, command: str) -> tuple[str, bool]:
        """The reply to one command, and whether the daemon quits."""
        words = command.split()
        if not words:
            return "", False
        if words[0] == "quit":
            return "", True
        if words[0] == "get_server_list":
            return "", False  # the fake starts no server: none to list
        if words[0] == "get_default_active_thread_percentage":
            return f"{self.threads:.1f}", False
        if words[0] == "set_default_active_thread_percentage" and len(words) == 2:
            try:
                value = float(words[1])
            except ValueError:
                value = -1.0
            if not 0 < value <= 100:
                return f"Invalid percentage {words[1]}", False
            self.threads = value
            return f"{self.threads:.1f}", False
        if words[0] == "set_default_device_pinned_mem_limit" and len(words) == 3:
            if not words[2][:-1].isdigit() or words[2][-1] not in "MG":
                return f"Invalid limit {words[2]}", False
            self.pinned[words[1]] = words[2]
            return "", False
        if words[0] == "get_default_device_pinned_mem_limit" and len(words) == 2:
            return self.pinned.get(words[1], "0"), False
        return f"Unrecognized command {command.strip()!r}", False

    def serve(self) -> int:
        self.pipe.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        path = self.pipe / CONTROL_SOCKET
        path.unlink(missing_ok=True)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(path))
        path.chmod(0o777)  # clients of any user connect, as to the real daemon
        server.listen(16)
        (self.pipe / PID_FILE).write_text(f"{os.getpid()}\n")
        self.log(f"Startup (fake nvidia-cuda-mps-control, pid {os.getpid()})")
        try:
            while True:
                conn, _ = server.accept()
                with conn, conn.makefile("rw") as stream:
                    for line in stream:
                        self.log(f"Command {line.strip()}")
                        reply, quit_now = self.answer(line)
                        if quit_now:
                            self.log("Exit")
                            return 0
                        stream.write(reply + "\n")
                        stream.flush()
        finally:
            server.close()
            path.unlink(missing_ok=True)
            (self.pipe / PID_FILE).unlink(missing_ok=True)


def _client(pipe: Path) -> int:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(pipe / CONTROL_SOCKET))
    except OSError as err:
        print(f"Cannot find MPS control daemon process ({err})", file=sys.stderr)
        return 1
    with s, s.makefile("rw") as stream:
        for line in sys.stdin:
            stream.write(line if line.endswith("\n") else line + "\n")
            stream.flush()
            if line.split()[:1] == ["quit"]:
                break
            reply = stream.readline()
            if reply.strip():
                sys.stdout.write(reply)
    return 0


def main(argv: list[str]) -> int:
    pipe, logs = _dirs()
    if not argv:
        return _client(pipe)
    if argv[0] == "-f":
        return _Daemon(pipe, logs).serve()
    if argv[0] == "-d":
        if os.fork() > 0:  # the caller's process returns at once, as the real tool's does
            return 0
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os._exit(_Daemon(pipe, logs).serve())
    print(f"usage: nvidia-cuda-mps-control [-d | -f] (got {' '.join(argv)})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
