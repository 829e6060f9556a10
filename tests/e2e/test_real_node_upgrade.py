"""A `helm upgrade` that ships a new hook never breaks a running container, on the real node.

The chart's device plugin runs from `make images`' `device-plugin:dev` (test_real_node.py shows
how); a second image, `device-plugin:dev2`, is built here by tools/images.sh with a hook whose
version string, and so content, differs. A container started before the upgrade keeps the
library it was given: its processes, old and new, still load the `dev` hook and are still held
to their grant after the plugin pod was replaced by `dev2`'s; a container started after gets
`dev2`'s. The old library stays on the host, byte for byte and inode for inode, while the old
pod runs, and goes once it has left the node.

Run only under the real node's lock: `flock /tmp/vgpu-realnode.lock pytest ...`.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from test_real_node import (  # noqa: F401  (node and prepared: this module's own real node)
    _FLAKY,
    NAMESPACE,
    NODE,
    SPLIT,
    Node,
    _fields,
    _log,
    _plugin_running,
    _sample_pod,
    node,
    prepared,
)
from vgpu_sandbox.realnode import daemons

from tests.support import wait_for
from vgpu.node.hooklib import record_path
from vgpu.node.paths import HostPaths

ROOT = Path(__file__).resolve().parents[2]
TAG = "dev2"
HOST = HostPaths(Path("/"))  # the chart mounts the host's /var/lib/vgpu into the plugin pod
# The sweep every 2 s, nothing kept for its age past 5 s: the old version goes within seconds
# of its pod rather than the defaults' five minutes.
SWEEP = ["--sweep-interval=2", "--sweep-min-age=5"]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

# Each line the hook's processes print: its version (VGPU_LOG_LEVEL=info), then t_alloc's counts.
ALLOC = "VGPU_LOG_LEVEL=info t_alloc link alloc 256 2>&1"


def _dev2_image() -> dict[str, Any]:
    """`device-plugin:dev2` from tools/images.sh in its own folder (rebuilt only when changed)."""
    image_dir = ROOT / ".cache" / "images-dev2"
    env = dict(os.environ, VGPU_IMAGE_TAG=TAG, VGPU_IMAGE_DIR=str(image_dir))
    built = subprocess.run(
        ["bash", str(ROOT / "tools" / "images.sh"), "device-plugin"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    info: dict[str, Any] = json.loads((image_dir / "images.json").read_text())["device-plugin"]
    assert info["ref"].endswith(f"/device-plugin:{TAG}")
    return info


def _hook_version_line(text: str) -> str:
    return next(
        (line.split("info: ", 1)[1] for line in text.splitlines() if "libvgpu.so version" in line), ""
    )


def _exec_alloc(real: Node, pod: str) -> dict[str, str]:
    out = real.kubectl("exec", "-n", "default", pod, "--", "sh", "-c", ALLOC, check=False).stdout
    if "alive=1" not in out:
        return {}
    return {**_fields(out), "hook": _hook_version_line(out)}


def _start(real: Node, name: str) -> tuple[dict[str, Any], str]:
    """A pod granted 3000 MiB that allocates 256 MiB chunks, then holds 1024 MiB until deleted."""
    command = f"{ALLOC}; echo holding; sleep infinity | t_hold 1024"
    manifest = _sample_pod(
        name, command, {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000", "nvidia.com/gpucores": "30"}
    )
    real.kubectl("apply", "-f", "-", input=json.dumps(manifest))

    def logs() -> str:
        status = real.get("pod", "-n", "default", name)["status"]
        assert status.get("phase") != "Failed", f"{name} failed: {status.get('message')}"
        out = real.kubectl("logs", "-n", "default", name, check=False).stdout
        return out if "holding" in out and "held=" in out else ""

    text = wait_for(logs, f"{name} to allocate and hold", 180, every=1.0, ignore=_FLAKY)
    return real.get("pod", "-n", "default", name), text


def _version_of(pod: dict[str, Any]) -> str:
    """The hook version the plugin recorded for the pod's container (vgpu/node/hooklib.py)."""
    return record_path(HOST, f"{pod['metadata']['uid']}_cuda").read_text().strip()


def _within_grant(fields: dict[str, str]) -> None:
    """1024 MiB are held in the container, so fewer 256 MiB chunks fit under 3000, then a refusal."""
    assert (
        int(fields["refused"]) == 2
        and 1 <= int(fields["chunks"])
        and int(fields["chunks"]) * 256 + 1024 <= 3000
    )


def _sweep_state(real: Node) -> str:
    """What the sweep decides from: the served folders, the records, the versions, the mounts,
    and the plugin's last lines."""
    lines = []
    for folder in (HOST.containers_dir, HOST.grants_dir, HOST.lib_dir):
        entries = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        lines.append(f"{folder}: {entries}")
    with open("/proc/self/mountinfo") as mounts:
        lines += [m.strip() for m in mounts if str(HOST.containers_dir) in m]
    pod = _plugin_running(real)
    if pod:
        logs = real.kubectl("logs", "-n", NAMESPACE, pod["metadata"]["name"], "--tail=30", check=False)
        lines.append(logs.stdout + logs.stderr)
    return "\n".join(lines)


def test_a_running_container_keeps_its_hook_across_a_helm_upgrade_and_the_old_library_goes_after_it(
    prepared: Node,  # noqa: F811  (the fixture imported above)
) -> None:
    real = prepared
    image = _dev2_image()
    imported = daemons.ctr(real.lay, "images", "import", image["file"])
    assert imported.returncode == 0, imported.stderr
    plugin = wait_for(lambda: _plugin_running(real), "the dev plugin pod", 180, every=1.0, ignore=_FLAKY)
    assert plugin["status"]["containerStatuses"][0]["image"].endswith("device-plugin:dev")

    old_pod, old_text = _start(real, "hook-old")
    old_version = _version_of(old_pod)
    old_library = HOST.lib_dir / old_version / "libvgpu.so"
    inode, digest = old_library.stat().st_ino, hashlib.sha256(old_library.read_bytes()).hexdigest()
    assert digest.startswith(old_version)
    assert _hook_version_line(old_text) == "libvgpu.so version dev", old_text
    first = _fields(old_text)  # before t_hold took its 1024 MiB: 256 MiB chunks up to 3000
    assert int(first["refused"]) == 2 and 8 <= int(first["chunks"]) <= 11, old_text
    before = old_pod["status"]["containerStatuses"][0]
    _log(f"hook-old runs the dev hook {old_version}: {old_library}")

    # The upgrade: the dev2 image, and a sweep fast enough to watch.
    helm = str(real.sandbox.bin("helm"))
    env = dict(os.environ, KUBECONFIG=str(real.sandbox.kubeconfig))
    values = json.loads(
        subprocess.run(
            [helm, "get", "values", "vgpu", "-n", NAMESPACE, "-o", "json"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    )
    args = [a for a in values["devicePlugin"].get("extraArgs", []) if not a.startswith("--sweep-")] + SWEEP
    registrations = real.kubelet_log().count("registration request from device plugin")
    started = time.monotonic()
    upgrade = subprocess.run(
        [
            helm,
            "upgrade",
            "vgpu",
            str(ROOT / "charts" / "vgpu"),
            "-n",
            NAMESPACE,
            "--reuse-values",
            "--set",
            f"devicePlugin.image.tag={TAG}",
            "--set-json",
            f"devicePlugin.extraArgs={json.dumps(args)}",
            "--wait",
            "--timeout",
            "240s",
        ],  # fmt: skip
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert upgrade.returncode == 0, upgrade.stdout[-2000:] + upgrade.stderr[-2000:]

    def upgraded() -> dict[str, Any] | None:
        pod = _plugin_running(real)
        image = pod["status"]["containerStatuses"][0]["image"] if pod else ""
        return pod if image.endswith(f"device-plugin:{TAG}") else None

    new_plugin = wait_for(upgraded, "the dev2 plugin pod to be ready", 180, every=1.0, ignore=_FLAKY)
    assert new_plugin["metadata"]["uid"] != plugin["metadata"]["uid"]
    # kubelet rejects a pod it admits between the old plugin's exit and the new one's devices
    # (UnexpectedAdmissionError); the new pod below waits for the registration and the devices.
    wait_for(
        lambda: real.kubelet_log().count("registration request from device plugin") > registrations,
        "the dev2 plugin to register with the kubelet",
        90,
        every=1.0,
        ignore=_FLAKY,
    )
    wait_for(
        lambda: real.get("node", NODE)["status"]["allocatable"].get("nvidia.com/gpu") == str(SPLIT),
        "the node to advertise nvidia.com/gpu again",
        90,
        every=1.0,
        ignore=_FLAKY,
    )
    _log(f"helm upgrade to device-plugin:{TAG}: {time.monotonic() - started:.1f}s")

    # The old container was not restarted and still enforces, with the hook it started with.
    after = real.get("pod", "-n", "default", "hook-old")["status"]["containerStatuses"][0]
    assert (
        after["containerID"] == before["containerID"]
        and after["restartCount"] == 0
        and after["state"].get("running")
    ), after
    fields = wait_for(
        lambda: _exec_alloc(real, "hook-old"), "kubectl exec in hook-old", 60, every=2, ignore=_FLAKY
    )
    assert fields["hook"] == "libvgpu.so version dev", fields
    _within_grant(fields)
    assert old_library.stat().st_ino == inode
    assert hashlib.sha256(old_library.read_bytes()).hexdigest() == digest
    _log(
        f"after the upgrade, hook-old: {fields['hook']}, "
        f"chunks={fields['chunks']} refused={fields['refused']}"
    )

    # A new container gets the new build.
    new_pod, new_text = _start(real, "hook-new")
    try:
        new_version = _version_of(new_pod)
        assert new_version != old_version
        assert _hook_version_line(new_text) == f"libvgpu.so version {TAG}", new_text
        assert (HOST.lib_dir / new_version / "libvgpu.so").is_file()
        _log(f"hook-new runs the {TAG} hook {new_version}")

        # Sweeps come and go (every 2 s, nothing kept for its age past 5 s): the old library stays
        # while hook-old runs.
        time.sleep(12)
        assert old_library.stat().st_ino == inode

        real.kubectl("delete", "pod", "-n", "default", "hook-old", "--wait=true", timeout=120)
        deleted = time.monotonic()
        try:
            wait_for(
                lambda: not old_library.parent.exists(),
                f"{old_library.parent} to go once hook-old left the node",
                90,
                every=1.0,
            )
        except AssertionError as err:
            raise AssertionError(f"{err}\n{_sweep_state(real)}") from None
        _log(f"{old_library.parent} removed {time.monotonic() - deleted:.1f}s after hook-old was deleted")
        assert (HOST.lib_dir / new_version / "libvgpu.so").is_file()
        fields = wait_for(
            lambda: _exec_alloc(real, "hook-new"), "kubectl exec in hook-new", 60, every=2, ignore=_FLAKY
        )
        assert fields["hook"] == f"libvgpu.so version {TAG}", fields
        _within_grant(fields)
    finally:
        real.kubectl("delete", "pod", "-n", "default", "hook-old", "hook-new", "--wait=false", check=False)
