"""kube-scheduler with its pprof endpoint open, for bench_dra.py ``--profile``: where its CPU goes
while it places a burst of claim pods.

kube-scheduler serves ``/debug/pprof/*`` on its secure port only (``enableProfiling`` is on by
default in its configuration); the sandbox starts it with ``--secure-port=0``. Here it gets a
port on 127.0.0.1, a self-signed serving certificate in the bench's folder, and the pprof paths in
``--authorization-always-allow-paths`` (no ``--authentication-kubeconfig``: the request is
anonymous). A thread waits for ``/readyz`` (the informers synced, so the profile holds the
burst, not the initial lists), then takes a CPU profile of ``seconds``; ``top`` prints its top
frames with ``go tool pprof``.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
import warnings
from pathlib import Path

import requests
from bench_scheduler import free_port
from vgpu_sandbox import controlplane
from vgpu_sandbox.cluster import Sandbox

PPROF_PATHS = "/healthz,/readyz,/livez,/debug/pprof,/debug/pprof/*"


class Profiled:
    """Starts kube-scheduler as bench_scheduler.start_scheduler does, with pprof reachable, and
    profiles it from ready for ``seconds`` into ``out``."""

    def __init__(self, sb: Sandbox, folder: Path, seconds: float, out: Path) -> None:
        self.sb, self.folder, self.seconds, self.out = sb, folder, seconds, out
        self.thread: threading.Thread | None = None
        self.error = ""

    def start(self, name: str, config_json: str) -> subprocess.Popen[bytes]:
        config = self.folder / f"{name}.json"
        config.write_text(config_json)
        port = free_port()
        certs = self.folder / "scheduler-certs"
        certs.mkdir(exist_ok=True)
        argv = [
            a
            for a in controlplane.scheduler_argv(self.sb.bin("kube-scheduler"), config)
            if not a.startswith("--secure-port")
        ]
        argv += [
            f"--secure-port={port}",
            "--bind-address=127.0.0.1",
            f"--cert-dir={certs}",
            f"--authorization-always-allow-paths={PPROF_PATHS}",
        ]
        log = (self.folder / f"{name}.log").open("ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.thread = threading.Thread(target=self._take, args=(port,), daemon=True)
        self.thread.start()
        return proc

    def _take(self, port: int) -> None:
        base = f"https://127.0.0.1:{port}"
        warnings.filterwarnings("ignore", message="Unverified HTTPS request")
        deadline = time.monotonic() + 120
        try:
            while time.monotonic() < deadline:
                try:
                    if requests.get(f"{base}/readyz", verify=False, timeout=2).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                time.sleep(0.2)
            r = requests.get(
                f"{base}/debug/pprof/profile",
                params={"seconds": str(int(self.seconds))},
                verify=False,
                timeout=self.seconds + 60,
            )
            r.raise_for_status()
            self.out.write_bytes(r.content)
        except (requests.RequestException, OSError) as e:
            self.error = f"profile not taken: {e}"

    def wait(self) -> str:
        """Waits for the profile; '' when written, else why not."""
        if self.thread is not None:
            self.thread.join(self.seconds + 90)
        return self.error


def top(binary: Path, profile: Path, count: int = 15) -> str:
    """``go tool pprof -top`` of ``profile``: the ``count`` frames with the most flat CPU, then
    the same by cumulative CPU."""
    go = shutil.which("go") or "/usr/local/go/bin/go"
    out = []
    for extra in ([], ["-cum"]):
        r = subprocess.run(
            [go, "tool", "pprof", "-top", f"-nodecount={count}", *extra, str(binary), str(profile)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        out.append(r.stdout if r.returncode == 0 else r.stderr)
    return "\n".join(out)
