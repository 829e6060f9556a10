"""The whole pod path on a real GPU: the upstream kubelet, containerd and runc, the device plugin on
real NVML, the hook, and a pod running PyTorch that asks for 3000 MiB and 30 % of a card.

``vgpu sandbox up --real-node --real-gpu --nodes 0`` as a fixture: the control plane, the extender
and its kube-scheduler as local processes, the real node (kubelet + containerd + plain runc, no
NVIDIA container toolkit), and ``vgpu device-plugin`` on the machine's cards with ``driverInject:
plugin``, so that the driver's device nodes and libraries reach the container through Allocate
alone. The pod's image is this machine's Python built into an image (tests/gpu/host_image.py);
PyTorch's environment is mounted read-only from the host.

Runs with ``pytest -m gpu`` as root on a GPU machine with containerd, runc and the CNI plugins
and the kubelet (``tools/build.sh kubelet``) and the pause image (``make images``, or its
pause.tar in $VGPU_IMAGE_DIR). With $VGPU_GPU_OUT set it writes the pod's log, ``vgpu status``,
the metrics lines and a summary there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vgpu_sandbox import binaries
from vgpu_sandbox.cluster import Sandbox, Spec
from vgpu_sandbox.realnode import configs, layout, prechecks

from tests.support import wait_for

pytestmark = pytest.mark.gpu

IMAGE = "docker.io/vgpu/host-torch:dev"
POD = "torch-3000"
LIMITS = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000", "nvidia.com/gpucores": "30"}
SCRIPT = r"""
import os, subprocess, sys, time
def show(*argv):
    try:
        done = subprocess.run(argv, capture_output=True, text=True)
        print(f"$ {' '.join(argv)}\n{done.stdout}{done.stderr}", flush=True)
    except OSError as err:
        head = open(argv[0], "rb").read(64) if os.path.exists(argv[0]) else b"(absent)"
        print(f"$ {' '.join(argv)}\nSHOW_FAILED={err!r} {head!r}", flush=True)
names = os.listdir("/usr/lib/x86_64-linux-gnu")
print("injected:", sorted(n for n in names if n.startswith(("libcuda", "libnvidia"))))
print("devices:", sorted(n for n in os.listdir("/dev") if n.startswith("nvidia")), flush=True)
print("tools:", sorted(n for n in os.listdir("/usr/bin") if n.startswith("nvidia")), flush=True)
show("/usr/bin/nvidia-smi", "--query-gpu=name,memory.total,memory.used", "--format=csv")
show("/usr/bin/nvidia-smi")
import torch
free, total = torch.cuda.mem_get_info()
print(f"TORCH_TOTAL_MIB={total >> 20}\nTORCH_FREE_MIB={free >> 20}", flush=True)
print(f"DEVICE={torch.cuda.get_device_name(0)}", flush=True)
held = torch.empty(1500 << 20, dtype=torch.uint8, device="cuda")
held.fill_(1)
torch.cuda.synchronize()
print("HELD_MIB=1500", flush=True)
try:
    more = torch.empty(2000 << 20, dtype=torch.uint8, device="cuda")
    print("REFUSED=no", flush=True)
except torch.OutOfMemoryError as err:
    print("REFUSED=yes")
    print("ERROR=" + str(err).splitlines()[0], flush=True)
a = torch.randn(4096, 4096, device="cuda")
b = a @ a
torch.cuda.synchronize()
t = time.time()
for _ in range(50):
    b = a @ a
torch.cuda.synchronize()
print(f"MATMUL_TFLOPS={50 * 2 * 4096**3 / (time.time() - t) / 1e12:.1f}", flush=True)
show("/usr/bin/nvidia-smi", "--query-gpu=memory.total,memory.used", "--format=csv")
print("HOLDING", flush=True)
time.sleep(float(os.environ.get("HOLD_S", "90")))
print("DONE", flush=True)
"""


def _out(name: str, text: str) -> None:
    folder = os.environ.get("VGPU_GPU_OUT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / name).write_text(text)


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    reason = prechecks.why_not(real_gpu=True)
    if reason:
        pytest.skip(f"no real node on this GPU machine: {reason}")
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        pytest.skip("PyTorch is not installed in this Python: the pod runs this machine's PyTorch")
    if not Path("/dev/nvidia-uvm").exists():  # created at the first CUDA use on some machines
        modprobe = shutil.which("nvidia-modprobe")
        init = [sys.executable, "-c", "import torch; torch.cuda.init()"]
        argv = [modprobe, "-u", "-c", "0"] if modprobe else init
        subprocess.run(argv, capture_output=True, timeout=120)
    state = Path(tempfile.mkdtemp(prefix="vgpu-gpu-", dir="/tmp"))
    box = Sandbox(state)
    t0 = time.monotonic()
    try:
        box.up(Spec(nodes=0, split=5, real_node=True, real_gpu=True), progress=lambda m: print(m, flush=True))
        print(f"sandbox with the real node on the GPU up in {time.monotonic() - t0:.1f}s", flush=True)
        yield box
    finally:
        for name in ("kubelet", "containerd", "device-plugin-real-node"):
            log = box.logs_dir / f"{name}.log"
            if log.exists():
                _out(f"{name}.log.tail", "\n".join(log.read_text(errors="replace").splitlines()[-300:]))
        box.down()
        shutil.rmtree(state, ignore_errors=True)


def _image(box: Sandbox) -> None:
    from host_image import build_rootfs, docker_archive  # tests/gpu is on sys.path

    work = Path(tempfile.mkdtemp(prefix="vgpu-img-", dir="/tmp"))
    try:
        t0 = time.monotonic()
        build_rootfs(work / "rootfs", Path(sys.prefix))
        archive = docker_archive(work / "rootfs", IMAGE, work / "host-torch.tar")
        lay = layout.layout_of(box)
        done = subprocess.run(
            [
                str(binaries.bin_dir() / "ctr"),  # containerd 2's own (tools/build.sh containerd)
                f"--address={lay.containerd_socket}",
                "--namespace=k8s.io",
                "images",
                "import",
                str(archive),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "CONTAINERD_SNAPSHOTTER": configs.snapshotter()},
        )
        assert done.returncode == 0, done.stderr
        print(
            f"image {IMAGE}: {archive.stat().st_size >> 20} MiB, built and imported in "
            f"{time.monotonic() - t0:.1f}s",
            flush=True,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _pod(python: str, prefix: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": POD, "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            # No pod network needed (and none on a kernel without bridges: realnode/lifecycle.py).
            "hostNetwork": True,
            "nodeSelector": {"kubernetes.io/hostname": layout.NAME},
            "terminationGracePeriodSeconds": 1,
            "tolerations": [{"key": layout.RESERVED["key"], "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [
                {
                    "name": "torch",
                    "image": IMAGE,
                    "imagePullPolicy": "Never",
                    "command": [python, "-c", SCRIPT],
                    "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
                    "resources": {"limits": LIMITS},
                    "volumeMounts": [{"name": "torch", "mountPath": prefix, "readOnly": True}],
                }
            ],
            "volumes": [{"name": "torch", "hostPath": {"path": prefix, "type": "Directory"}}],
        },
    }


def test_a_pytorch_pod_on_the_real_gpu_is_held_to_3000_mib(sandbox: Sandbox) -> None:
    box = sandbox
    _image(box)
    box.kubectl("apply", "-f", "-", input=json.dumps(_pod(sys.executable, sys.prefix)))

    def logs() -> str:
        done = box.kubectl("logs", "-n", "default", POD, check=False)
        return done.stdout if "HOLDING" in done.stdout or "Traceback" in done.stdout else ""

    t0 = time.monotonic()
    try:
        text = wait_for(logs, "the pod to allocate and hold (kubectl logs)", 300, 2.0)
    except AssertionError:
        described = box.kubectl("describe", "pod", "-n", "default", POD, check=False).stdout
        _out("pod-describe.txt", described)
        raise AssertionError(described[-4000:]) from None
    _out("pod.log", text)
    print(f"pod running and holding after {time.monotonic() - t0:.1f}s\n{text}", flush=True)
    crashed = "Traceback" in text

    # Everything is collected (and written to $VGPU_GPU_OUT) before anything is asserted.
    # vgpu status: the grant and, from the pod's region through the plugin's Lease, its usage.
    vgpu = [sys.executable, "-m", "vgpu.commands.cli", "status", f"--kubeconfig={box.kubeconfig}"]
    using = re.compile(rf"default/{POD} .*using (\d+) MiB")

    def status_text() -> str:
        done = subprocess.run(vgpu, capture_output=True, text=True, timeout=60)
        return done.stdout + done.stderr

    def status() -> str:
        # The Lease carries the usage of the plugin's last renewal (every 10 s): wait for one made
        # after the pod took its memory, not the one from before (``using 0 MiB``).
        out = status_text()
        found = using.search(out)
        return out if found and int(found.group(1)) > 0 else ""

    try:
        shown = status_text() if crashed else wait_for(status, "vgpu status to show the pod's usage", 60, 2.0)
    except AssertionError:
        shown = status_text()
    _out("vgpu-status.txt", shown)
    print(shown, flush=True)
    # The monitor's metrics: the container's memory, read from its region.
    port = box.state().ports["real-node-monitor"]  # type: ignore[union-attr]
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    lines = [ln for ln in body.splitlines() if POD in ln and ln.startswith("vgpu_container_memory_")]
    _out("metrics.txt", "\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    pod = json.loads(box.kubectl("get", "pod", "-n", "default", POD, "-o", "json").stdout)

    assert not crashed, text
    fields = dict(re.findall(r"^([A-Z_]+)=(.*)$", text, re.M))
    # Refused past the limit inside the pod, with PyTorch's own error.
    assert fields.get("REFUSED") == "yes", text
    assert "out of memory" in fields.get("ERROR", "").lower(), text
    # The card as the pod sees it: its grant, through CUDA (PyTorch) and NVML (nvidia-smi).
    assert int(fields["TORCH_TOTAL_MIB"]) == 3000, text
    assert re.search(r"^NVIDIA H[^\n]*, 3000 MiB, ", text, re.M), text
    assert re.search(r"^3000 MiB, ", text, re.M), text
    # The driver came from the plugin: its libraries, its nvidia-smi and the card's device node.
    assert "libcuda.so.1" in text and "libnvidia-ml.so.1" in text and "'nvidiactl'" in text, text
    assert pod["spec"]["schedulerName"] == "vgpu-scheduler"
    assert pod["metadata"]["annotations"].get("vgpu.openaios.io/phase") == "allocated"

    assert re.search(r"mem 3000/\d+ MiB\s+cores 30/100", shown), shown
    found = using.search(shown)
    assert found and 1500 <= int(found.group(1)) <= 3000, shown
    used_line = next(ln for ln in lines if ln.startswith("vgpu_container_memory_used_bytes"))
    assert 1500 << 20 <= float(used_line.rsplit(" ", 1)[1]) <= 3000 << 20, used_line
    limit_line = next(ln for ln in lines if ln.startswith("vgpu_container_memory_limit_bytes"))
    assert float(limit_line.rsplit(" ", 1)[1]) == 3000 << 20, limit_line
    box.kubectl("delete", "pod", "-n", "default", POD, "--wait=false", check=False)
