"""The DRA path on a real GPU: a pod whose ResourceClaim asks for 3000Mi and 30 cores of the card,
prepared by ``vgpu dra-plugin`` (NodePrepareResources: the grant, the region folder and the CDI
spec, which containerd 2 applies), is held to its claim by the hook.

``vgpu sandbox up --real-node --real-gpu --dra --nodes 0`` as a fixture: the control plane, the
real node (kubelet 1.36, containerd 2 with CDI, plain runc, no NVIDIA container toolkit) labelled
``openaios.io/gpu-mode=dra``, the DeviceClass ``vgpu.openaios.io``, and ``vgpu dra-plugin`` on
the machine's cards (real NVML) with ``driverInject: plugin``, so that the claim's CDI spec carries
the driver's device nodes and libraries. The pod's image is this machine's Python
(tests/gpu/host_image.py) with PyTorch mounted read-only from the host. Inside, PyTorch allocates
256 MiB at a time until refused (at most 64 chunks: 16 GiB, never more than the card holds), then
runs bf16 matrix products for LOOP_S seconds while this test samples the card's utilization
through NVML on the host.

Checked: the card seen from inside is 3000 MiB and the allocations are refused below it (the
context's charge included), with PyTorch's own error; the loop's share of the card stays within
the claim's 30 % + 5 points; the claim's CDI spec names its grant, the hook and the driver's
files; ``vgpu status`` shows the claim on the card; the card's health (real NVML, through the
plugin's health stream) shows Healthy in the pod's status; the spec goes when the pod goes.
Prints one JSON line of figures (``DRA_GPU {...}``) and, with $VGPU_GPU_OUT set, writes the pod's
log, the CDI spec, ``vgpu status``, the daemons' log tails and the figures there.
Runs with ``pytest -m gpu`` as root on a GPU machine with the 1.36 kubelet and containerd 2 in
``$VGPU_BIN_DIR/current`` (tools/gpu-bundle.sh stages them) and the pause image.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vgpu_sandbox import binaries, realdra
from vgpu_sandbox.cluster import Sandbox, Spec
from vgpu_sandbox.realnode import configs, layout, prechecks

from tests.support import wait_for
from tests.support.dra import resource_health

pytestmark = pytest.mark.gpu

IMAGE = "docker.io/vgpu/host-torch:dev"
POD = "torch-dra"
MEMORY_MIB, CORES, SLACK_PTS = 3000, 30, 5.0
LOOP_S = 15
SCRIPT = r"""
import os, sys, time
import torch
free, total = torch.cuda.mem_get_info()
print(f"TORCH_TOTAL_MIB={total >> 20}\nTORCH_FREE_MIB={free >> 20}", flush=True)
print(f"DEVICE={torch.cuda.get_device_name(0)}", flush=True)
print("devices:", sorted(n for n in os.listdir("/dev") if n.startswith("nvidia")), flush=True)
print("grant:", os.path.exists("/etc/vgpu/limits"), flush=True)
chunks, error = [], ""
while len(chunks) < 64:  # 16 GiB at most: a small part of any card this runs on
    try:
        chunk = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        chunk.fill_(1)
        chunks.append(chunk)
    except torch.OutOfMemoryError as err:
        error = str(err).splitlines()[0]
        break
torch.cuda.synchronize()
print(f"CHUNKS={len(chunks)}\nGOT_MIB={len(chunks) * 256}", flush=True)
print(f"REFUSED={'yes' if error else 'no'}\nERROR={error}", flush=True)
print(f"FREE_AT_REFUSAL_MIB={torch.cuda.mem_get_info()[0] >> 20}", flush=True)
chunks.clear()
chunk = None
torch.cuda.empty_cache()
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
c = torch.empty_like(a)
for _ in range(24):
    torch.matmul(a, b, out=c)
torch.cuda.synchronize()
loop_s = float(os.environ["LOOP_S"])
t0, n = time.time(), 0
while time.time() - t0 < loop_s:
    for _ in range(8):
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    n += 8
t1 = time.time()
print(f"LOOP_T0={t0:.3f}\nLOOP_T1={t1:.3f}\nMATMULS={n}", flush=True)
print(f"TFLOPS={n * 2 * 8192**3 / (t1 - t0) / 1e12:.1f}", flush=True)
print("HOLDING", flush=True)
time.sleep(float(os.environ.get("HOLD_S", "120")))
"""


def _out(name: str, text: str) -> None:
    folder = os.environ.get("VGPU_GPU_OUT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"dra-{name}").write_text(text)  # beside test_pod_on_gpu.py's files


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    reason = prechecks.why_not(real_gpu=True)
    if reason:
        pytest.skip(f"no real node on this GPU machine: {reason}")
    import importlib.util

    for module, why in (("torch", "the pod runs this machine's PyTorch"), ("pynvml", "the card is measured")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed in this Python: {why}")
    version = subprocess.run(
        [str(binaries.bin_dir() / "containerd"), "--version"], capture_output=True, text=True
    )
    if not re.search(r"\sv?2\.", version.stdout):
        pytest.skip(f"DRA needs containerd 2 (CDI): {version.stdout.strip()} (tools/gpu-bundle.sh stages it)")
    if not Path("/dev/nvidia-uvm").exists():  # created at the first CUDA use on some machines
        modprobe = shutil.which("nvidia-modprobe")
        init = [sys.executable, "-c", "import torch; torch.cuda.init()"]
        subprocess.run([modprobe, "-u", "-c", "0"] if modprobe else init, capture_output=True, timeout=120)
    state = Path(tempfile.mkdtemp(prefix="vgpu-dra-gpu-", dir="/tmp"))
    box = Sandbox(state)
    t0 = time.monotonic()
    try:
        spec = Spec(nodes=0, split=5, real_node=True, real_gpu=True, dra=True)
        box.up(spec, progress=lambda m: print(m, flush=True))
        print(f"sandbox with the real node in DRA mode up in {time.monotonic() - t0:.1f}s", flush=True)
        yield box
    finally:
        for name in ("kubelet", "containerd", realdra.COMPONENT):
            log = box.logs_dir / f"{name}.log"
            if log.exists():
                _out(f"{name}.log.tail", "\n".join(log.read_text(errors="replace").splitlines()[-300:]))
        box.down()
        shutil.rmtree(state, ignore_errors=True)


def _image(box: Sandbox) -> None:
    from host_image import build_rootfs, docker_archive  # tests/gpu is on sys.path

    work = Path(tempfile.mkdtemp(prefix="vgpu-img-", dir="/tmp"))
    try:
        build_rootfs(work / "rootfs", Path(sys.prefix))
        archive = docker_archive(work / "rootfs", IMAGE, work / "host-torch.tar")
        lay = layout.layout_of(box)
        ctr = [str(binaries.bin_dir() / "ctr"), f"--address={lay.containerd_socket}", "--namespace=k8s.io"]
        done = subprocess.run(
            [*ctr, "images", "import", str(archive)],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "CONTAINERD_SNAPSHOTTER": configs.snapshotter()},
        )
        assert done.returncode == 0, done.stderr
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _objects(python: str, prefix: str) -> dict[str, Any]:
    capacity = {"memory": f"{MEMORY_MIB}Mi", "cores": str(CORES)}
    request = {
        "name": "gpu",
        "exactly": {"deviceClassName": realdra.DRIVER, "capacity": {"requests": capacity}},
    }
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": POD, "namespace": "default"},
        "spec": {"spec": {"devices": {"requests": [request]}}},
    }
    container = {
        "name": "torch",
        "image": IMAGE,
        "imagePullPolicy": "Never",
        "command": [python, "-c", SCRIPT],
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": "LOOP_S", "value": str(LOOP_S)}],
        "resources": {"claims": [{"name": "gpu"}]},
        "volumeMounts": [{"name": "torch", "mountPath": prefix, "readOnly": True}],
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": POD, "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "hostNetwork": True,  # no pod network needed (vgpu_sandbox.realnode.lifecycle)
            "nodeSelector": {"kubernetes.io/hostname": layout.NAME},
            "terminationGracePeriodSeconds": 1,
            "tolerations": layout.TOLERATIONS,
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": POD}],
            "containers": [container],
            "volumes": [{"name": "torch", "hostPath": {"path": prefix, "type": "Directory"}}],
        },
    }
    return {"apiVersion": "v1", "kind": "List", "items": [template, pod]}


class Sampler:
    """The cards' utilization (NVML on the host, every 0.2 s) with the wall-clock time of each."""

    def __init__(self) -> None:
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self.samples: list[tuple[float, list[int]]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.2):
            with_errors = []
            for h in self.handles:
                try:
                    with_errors.append(int(self.nvml.nvmlDeviceGetUtilizationRates(h).gpu))
                except self.nvml.NVMLError:
                    with_errors.append(-1)
            self.samples.append((time.time(), with_errors))

    def mean(self, card: int, t0: float, t1: float) -> tuple[float, int]:
        got = [u[card] for t, u in self.samples if t0 <= t <= t1 and u[card] >= 0]
        return (statistics.fmean(got) if got else -1.0), len(got)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.nvml.nvmlShutdown()


def test_a_pytorch_pod_is_held_to_its_claim_on_the_real_gpu(sandbox: Sandbox) -> None:
    box = sandbox
    t_start = time.monotonic()
    _image(box)
    image_s = time.monotonic() - t_start
    sampler = Sampler()
    try:
        box.kubectl("apply", "-f", "-", input=json.dumps(_objects(sys.executable, sys.prefix)))

        def logs() -> str:
            out = box.kubectl("logs", "-n", "default", POD, check=False).stdout
            return out if "HOLDING" in out or "Traceback" in out else ""

        try:
            text = wait_for(logs, "the pod to allocate, loop and hold (kubectl logs)", 240, 2.0)
        except AssertionError:
            described = box.kubectl("describe", "pod", "-n", "default", POD, check=False).stdout
            claims = box.kubectl("get", "resourceclaims", "-A", "-o", "yaml", check=False).stdout
            _out("pod-describe.txt", described + "\n---\n" + claims)
            raise AssertionError(described[-3000:] + "\n" + claims[-2000:]) from None
    finally:
        sampler.close()
    _out("pod.log", text)
    print(text, flush=True)
    crashed = "Traceback" in text
    fields = dict(re.findall(r"^([A-Z_0-9]+)=(.*)$", text, re.M))

    # Everything is collected (and written to $VGPU_GPU_OUT) before anything is asserted.
    claim = next(
        c
        for c in json.loads(box.kubectl("get", "resourceclaims", "-n", "default", "-o", "json").stdout)[
            "items"
        ]
        if any(r.get("name") == POD for r in c.get("status", {}).get("reservedFor", []))
    )
    uid = claim["metadata"]["uid"]
    result = claim["status"]["allocation"]["devices"]["results"][0]
    card = int(m.group(1)) if (m := re.search(r"(\d+)$", result["device"])) else 0
    spec_file = realdra.CDI_DIR / f"{realdra.DRIVER}-claim_{uid}.json"
    cdi = json.loads(spec_file.read_text()) if spec_file.exists() else {}
    _out("cdi-spec.json", json.dumps(cdi, indent=2))
    vgpu = [sys.executable, "-m", "vgpu.commands.cli", "status", f"--kubeconfig={box.kubeconfig}"]
    shown = subprocess.run(vgpu, capture_output=True, text=True, timeout=60)
    status = shown.stdout + shown.stderr
    _out("vgpu-status.txt", status)
    print(status, flush=True)
    share, samples = -1.0, 0
    if "LOOP_T0" in fields:  # the first 3 s: the limiter's burst and ramp
        share, samples = sampler.mean(card, float(fields["LOOP_T0"]) + 3, float(fields["LOOP_T1"]))
    figures = {
        "claim_mib": MEMORY_MIB,
        "claim_cores": CORES,
        "device": result["device"],
        "torch_total_mib": int(fields.get("TORCH_TOTAL_MIB", -1)),
        "got_mib": int(fields.get("GOT_MIB", -1)),
        "refused": fields.get("REFUSED"),
        "free_at_refusal_mib": int(fields.get("FREE_AT_REFUSAL_MIB", -1)),
        "card_util_pct": round(share, 1),
        "util_samples": samples,
        "tflops": float(fields.get("TFLOPS", -1)),
        "image_s": round(image_s, 1),
        "pod_s": round(time.monotonic() - t_start - image_s, 1),
    }
    _out("figures.json", json.dumps(figures) + "\n")
    print("DRA_GPU " + json.dumps(figures), flush=True)

    assert not crashed, text
    # Held to the claim's memory, the context's charge included: the card is 3000 MiB from
    # inside, and 256 MiB chunks are refused with PyTorch's own error before 3000 MiB of them.
    assert figures["torch_total_mib"] == MEMORY_MIB, text
    assert fields.get("REFUSED") == "yes", text
    assert "out of memory" in fields.get("ERROR", "").lower(), text
    assert 1500 <= figures["got_mib"] <= MEMORY_MIB - 184, text  # 11 chunks at most
    # Held to the claim's cores: the loop's share of the card's time, as NVML sees it on the host.
    assert samples >= 20, f"too few NVML samples during the loop: {samples}"
    assert 10.0 <= share <= CORES + SLACK_PTS, f"card utilization {share:.1f} % under a {CORES} % claim"
    # The spec the runtime applied: the grant, the hook, the driver's files (driverInject: plugin).
    edits = cdi["devices"][0]["containerEdits"]
    mounts = {m["containerPath"]: m["hostPath"] for m in edits.get("mounts", [])}
    assert mounts.get("/etc/vgpu/limits", "").endswith(f"dra_{uid}_gpu.limits"), mounts
    assert Path(mounts["/etc/vgpu/limits"]).is_file()
    assert "/etc/ld.so.preload" in mounts and any("libvgpu" in h for h in mounts.values()), mounts
    assert any(p.endswith("libcuda.so.1") for p in mounts), mounts
    assert "/dev/nvidiactl" in {d["path"] for d in edits.get("deviceNodes", [])}, edits
    assert f"CUDA_DEVICE_MEMORY_LIMIT_0={MEMORY_MIB}m" in edits["env"], edits["env"]
    assert f"CUDA_DEVICE_SM_LIMIT_0={CORES}" in edits["env"], edits["env"]
    # vgpu status: the DRA node, the card's consumed capacity and the claim on it.
    assert re.search(r"mode dra", status), status
    assert re.search(rf"mem {MEMORY_MIB}/\d+ MiB\s+cores {CORES}/100", status), status
    assert re.search(rf"default/{POD} claim \S+/gpu\s+{MEMORY_MIB} MiB\s+{CORES}%", status), status

    # The card's health, from real NVML through the plugin's DRAResourceHealth stream, in the pod's
    # status as the kubelet 1.36 shows it (resource ID: the claim's CDI device).
    def healthy() -> dict[str, tuple[str, str]]:  # empty until the kubelet has heard of the card
        pod = json.loads(box.kubectl("get", "pod", "-n", "default", POD, "-o", "json").stdout)
        got = resource_health(pod)
        return {} if any(h == "Unknown" for h, _ in got.values()) else got

    health = wait_for(healthy, "the card's health in the pod's allocatedResourcesStatus", 60, 1.0)
    print(f"DRA_GPU health {health}", flush=True)
    assert health == {f"{realdra.DRIVER}/claim={uid}-gpu": ("Healthy", "")}, health
    # The pod goes: the kubelet unprepares the claim and its spec leaves the CDI folder.
    box.kubectl("delete", "pod", "-n", "default", POD, "--wait=true", "--timeout=60s", timeout=90)
    wait_for(lambda: not spec_file.exists(), "the claim's CDI spec to go (NodeUnprepareResources)", 60, 1.0)
