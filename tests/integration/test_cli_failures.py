"""Every `vgpu` command, as a person first meets it: against a cluster that is not there, and with
sizes out of range, it says what went wrong in one line (and what to do) and never a traceback.

The commands come from the argparse parser itself, so a new subcommand (or action) without a case
here fails ``test_every_command_has_a_case``. Each case runs as a subprocess, as a person runs it.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import support
from tests.support.region import format_region
from tests.support.tmp import short_dir
from vgpu.commands.cli import build_parser
from vgpu.node.paths import REGION_FILE_NAME

GPUS = "gpus:\n  - {uuid: GPU-a, memoryMiB: 1000}\n"


def leaves(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every runnable command path: ("status",), ("limits", "set"), ("sandbox", "up"), ..."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield prefix
        return
    for action in subs:
        for name, child in action.choices.items():
            yield from leaves(child, (*prefix, name))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class World:
    """What the cases point at: a kubeconfig naming a closed port, folders of their own."""

    tmp: Path
    kubeconfig: Path
    server: str
    gpus: Path
    container: Path
    sandbox_dir: Path


@pytest.fixture
def world(tmp_path: Path) -> World:
    server = f"https://127.0.0.1:{closed_port()}"
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: '{server}', insecure-skip-tls-verify: true}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text(GPUS)
    container = tmp_path / "uid-1_main"
    container.mkdir()
    format_region(container / REGION_FILE_NAME, ["GPU-a"])
    return World(tmp_path, kubeconfig, server, gpus, container, tmp_path / "sb")


def vgpu(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """With VGPU_DEBUG cleared: a traceback shown on purpose would hide one shown by mistake."""
    return support.vgpu(*args, env={"VGPU_DEBUG": "", **(env or {})}, timeout=timeout)


def one_line_failure(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The command failed, said so in one line of stderr naming ``needles``, without a traceback."""
    assert result.returncode != 0, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def run_daemon(argv: list[str], until: str, poke: Callable[[], None] | None = None) -> str:
    """Run a long-running command against the missing cluster until its output shows ``until``
    (at most a minute; ``poke`` it then), and stop it as Kubernetes does (SIGTERM); its output."""
    proc = subprocess.Popen(
        [*support.VGPU, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "VGPU_DEBUG": ""},
        start_new_session=True,
    )
    lines: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not any(until in line for line in list(lines)) and time.monotonic() < deadline:
            assert proc.poll() is None, "".join(lines)
            time.sleep(0.2)
        if poke is not None:
            poke()
        time.sleep(1)  # what follows the first failure: its retries
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        reader.join(timeout=10)
        return "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def daemon_kept_retrying(output: str, server: str) -> None:
    """No traceback, and each failure it logged is one line naming the server and the cause."""
    assert "Traceback" not in output, output[-3000:]
    ours = [line for line in output.splitlines() if "cannot reach the API server" in line]
    assert ours, output[-3000:]
    assert all(f"at {server} (connection refused)" in line for line in ours), ours[:3]


def case_extender(w: World) -> None:
    out = run_daemon(
        [
            "extender",
            f"--kubeconfig={w.kubeconfig}",
            "--insecure-http",
            "--listen=127.0.0.1:0",
            "--metrics-listen=127.0.0.1:0",
        ],
        until="cannot reach",
    )
    daemon_kept_retrying(out, w.server)
    # and what it refuses before starting: one line, exit 2
    one_line_failure(vgpu("extender", f"--kubeconfig={w.kubeconfig}"), "--cert-file")


def case_device_plugin(w: World) -> None:
    argv = [
        "device-plugin",
        "--node=n1",
        f"--kubeconfig={w.kubeconfig}",
        f"--root={w.tmp / 'root'}",
        f"--fake-nvml={w.gpus}",
        "--monitor-listen=127.0.0.1:0",
    ]
    daemon_kept_retrying(run_daemon(argv, until="cannot reach"), w.server)
    one_line_failure(vgpu(*argv[:-2], f"--fake-nvml={w.tmp / 'none.yaml'}"), "--fake-nvml", "cannot read")


def case_dra_plugin(w: World) -> None:
    with short_dir("vgpu-dra-cli-") as sockets:  # pytest's tmp_path is too long for a unix socket
        argv = [
            "dra-plugin",
            "--node-name=n1",
            f"--kubeconfig={w.kubeconfig}",
            f"--plugin-dir={sockets / 'plugins'}",
            f"--registry-dir={sockets / 'registry'}",
            f"--cdi-dir={w.tmp / 'cdi'}",
            f"--state-dir={w.tmp / 'state'}",
            f"--fake-nvml={w.gpus}",
        ]
        daemon_kept_retrying(run_daemon(argv, until="cannot reach"), w.server)
        one_line_failure(vgpu(*argv[:-1], f"--fake-nvml={w.tmp / 'none.yaml'}"), "--fake-nvml", "cannot read")


def case_monitor(w: World) -> None:
    port = closed_port()

    def scrape() -> None:
        # pod names come from the API server on each scrape: the missing one costs them, not /metrics
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
                    assert resp.status == 200
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    argv = [
        "monitor",
        "--node=n1",
        f"--kubeconfig={w.kubeconfig}",
        f"--root={w.tmp / 'root'}",
        f"--fake-nvml={w.gpus}",
        f"--listen=127.0.0.1:{port}",
    ]
    out = run_daemon(argv, until="node monitor on", poke=scrape)
    assert "Traceback" not in out, out[-3000:]
    one_line_failure(vgpu(*argv[:-1], "--listen=nowhere"), "--listen")


def case_status(w: World) -> None:
    line = one_line_failure(
        vgpu("status", f"--kubeconfig={w.kubeconfig}"),
        f"cannot reach the API server at {w.server} (connection refused)",
        "is the cluster up",
    )
    assert line.startswith("vgpu status: ")
    one_line_failure(
        vgpu("status", env={"KUBECONFIG": str(w.kubeconfig)}), "(connection refused)", "$KUBECONFIG"
    )
    one_line_failure(vgpu("status", "--node=nope", f"--kubeconfig={w.kubeconfig}"), "cannot reach")
    one_line_failure(vgpu("status", f"--kubeconfig={w.tmp / 'missing'}"), "no such file")
    alone = {"KUBECONFIG": "", "VGPU_SANDBOX_DIR": str(w.sandbox_dir), "KUBERNETES_SERVICE_HOST": ""}
    one_line_failure(vgpu("status", env=alone), "no kubeconfig", "--kubeconfig", "vgpu sandbox up")


def case_limits_show(w: World) -> None:
    one_line_failure(vgpu("limits", "show", f"--container-dir={w.tmp / 'gone'}"), "cannot open region file")


def case_limits_set(w: World) -> None:
    before = (w.container / REGION_FILE_NAME).read_bytes()
    where = f"--container-dir={w.container}"
    for flag, size in (
        ("--memory", "17179869184g"),  # 2^64 bytes
        ("--memory", "18446744073709551616b"),
        ("--budget", "99999999999999999999"),
        ("--budget", "18014398509481984k"),  # 2^64 bytes
    ):
        result = vgpu("limits", "set", where, "--device=0", f"{flag}={size}")
        assert result.returncode == 2
        one_line_failure(result, f"{flag}: '{size}' is more than 2^64-1 bytes", "give a smaller size")
    one_line_failure(vgpu("limits", "set", where, "--device=0", "--memory=²"), "--memory", "not a size")
    one_line_failure(vgpu("limits", "set", where, "--device=99999999999999999999", "--cores=5"), "--device")
    one_line_failure(vgpu("limits", "set", where, "--device=0", "--cores=99999999999999999999"), "--cores")
    assert (w.container / REGION_FILE_NAME).read_bytes() == before
    # the largest size there is still fits
    assert vgpu("limits", "set", where, "--device=0", "--budget=17179869183g").returncode == 0


def case_sandbox_up(w: World) -> None:
    sb = ["sandbox", f"--dir={w.sandbox_dir}", "up"]
    one_line_failure(vgpu(*sb, "--nodes=0"), "--nodes")
    one_line_failure(vgpu(*sb, "--apiserver-port=99999999999999999999"), "--apiserver-port")
    one_line_failure(vgpu(*sb, "--nodes=1"), "too deep", "--dir")  # pytest's folders are long


def case_sandbox_restart(w: World) -> None:
    one_line_failure(vgpu("sandbox", f"--dir={w.sandbox_dir}", "restart", "kubelet"), "no sandbox")


def case_sandbox_status(w: World) -> None:
    result = vgpu("sandbox", f"--dir={w.sandbox_dir}", "status")
    # nothing is wrong where nothing was started: it says so and how to start one
    assert result.returncode == 0 and result.stderr == ""
    assert (
        result.stdout.strip() == f"no sandbox in {w.sandbox_dir.resolve()}: start one with `vgpu sandbox up`"
    )


def case_sandbox_kubeconfig(w: World) -> None:
    one_line_failure(vgpu("sandbox", f"--dir={w.sandbox_dir}", "kubeconfig"), "no sandbox", "vgpu sandbox up")


def case_sandbox_down(w: World) -> None:
    result = vgpu("sandbox", f"--dir={w.sandbox_dir}", "down")
    assert result.returncode == 0 and result.stdout.strip() == "sandbox: nothing was running"


CASES: dict[tuple[str, ...], Callable[[World], None]] = {
    ("extender",): case_extender,
    ("device-plugin",): case_device_plugin,
    ("monitor",): case_monitor,
    ("status",): case_status,
    ("limits", "show"): case_limits_show,
    ("limits", "set"): case_limits_set,
    ("sandbox", "up"): case_sandbox_up,
    ("sandbox", "restart"): case_sandbox_restart,
    ("sandbox", "status"): case_sandbox_status,
    ("sandbox", "kubeconfig"): case_sandbox_kubeconfig,
    ("sandbox", "down"): case_sandbox_down,
    ("dra-plugin",): case_dra_plugin,
}


def test_every_command_has_a_case() -> None:
    assert set(leaves(build_parser())) == set(CASES)


@pytest.mark.parametrize("command", list(CASES), ids=" ".join)
def test_a_command_fails_in_one_line_without_a_traceback(world: World, command: tuple[str, ...]) -> None:
    CASES[command](world)
