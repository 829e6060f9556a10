"""The real node's life: :func:`start` (containerd, the images, the bridge, the kubelet, then the
node's device plugin in its mode, or the inventory for the playbook's), :func:`restart` of
containerd or the kubelet, and :func:`stop`, which leaves nothing behind. What the sandbox created
on the host and how often it restarted what is recorded in the layout's ``node.json``."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from vgpu_sandbox import binaries, nodes, procs, realdra, realgpu, realmps, realruntime
from vgpu_sandbox.errors import SandboxError
from vgpu_sandbox.realnode import configs, daemons, values
from vgpu_sandbox.realnode.layout import (
    BRIDGE,
    COMPONENTS,
    FAKE_NVML_MOUNT,
    HOST_PATHS,
    HOST_PLUGIN_DIR,
    MONITOR_PORT,
    NAME,
    NODE_IP,
    POD_SUBNET,
    NodeLayout,
    built_images,
    image_dir,
    images_for,
    inventory_file,
    layout_of,
    pod_cgroups,
)
from vgpu_sandbox.realnode.prechecks import cni_dir, socket_answers
from vgpu_sandbox.runtime import Handle, Spec, write_whole


def _load_record(lay: NodeLayout) -> dict[str, Any]:
    try:
        loaded = json.loads(lay.record.read_text())
        return loaded if isinstance(loaded, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_record(lay: NodeLayout, record: dict[str, Any]) -> None:
    write_whole(lay.record, json.dumps(record, indent=2))


def start(sandbox: Handle, spec: Spec, progress: Callable[[str], None]) -> None:
    """containerd, the images, then the kubelet; returns when the node is Ready.

    ``Sandbox.up`` has checked ``why_not`` before it started anything."""
    lay = layout_of(sandbox)
    lay.root.mkdir(mode=0o700)
    for folder in (
        lay.containerd_root,
        lay.containerd_state.parent,
        lay.cni_conf_dir,
        lay.cni_data,
        lay.kubelet_root,
    ):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "created": [str(p) for p in HOST_PATHS if not p.exists()],
        "restarts": {c: 0 for c in COMPONENTS},
        "timings": {},
    }
    _save_record(lay, record)
    images = built_images()
    cni_bin = cni_dir()
    assert cni_bin is not None
    lay.containerd_config.write_text(
        configs.containerd_config(lay, images["pause"]["ref"], cni_bin, configs.snapshotter())
    )
    (lay.cni_conf_dir / "10-vgpu-sandbox.conflist").write_text(json.dumps(configs.cni_config(lay), indent=2))

    progress(f"real node: starting containerd ({lay.containerd_config})")
    t0 = time.monotonic()
    sandbox.launch("containerd", daemons.containerd_argv(lay))
    daemons.wait_containerd(sandbox, lay)

    wanted = images_for(spec.real_gpu)
    progress(f"real node: importing {len(wanted)} images from {image_dir()}")
    t1 = time.monotonic()
    for name in wanted:
        imported = daemons.ctr(lay, "images", "import", images[name]["file"])
        if imported.returncode != 0:
            raise SandboxError(f"ctr images import {images[name]['file']} failed: {imported.stderr.strip()}")
    listed = set(daemons.ctr(lay, "images", "list", "--quiet").stdout.split())
    absent = [images[n]["ref"] for n in wanted if images[n]["ref"] not in listed]
    if absent:
        raise SandboxError(f"containerd does not list {', '.join(absent)} after the import; see its log")
    record["timings"]["images_import_s"] = round(time.monotonic() - t1, 1)

    gpu = nodes.GPUSpec(spec.gpus_per_node, spec.gpu_memory_mib, spec.gpu_model, spec.split)
    lay.stub_procs.mkdir(exist_ok=True)
    lay.stub_procs.chmod(0o1777)  # a sample pod's process may run as any user
    gpus = nodes.fake_gpus(NAME, gpu)
    if spec.dra and spec.mig == "dynamic":
        gpus[0].update(realdra.MIG_CARD)  # the fake NVML's H100 in MIG mode (--dra --mig dynamic)
    described = {"gpus": gpus, "processDir": f"{FAKE_NVML_MOUNT}/{lay.stub_procs.name}"}
    lay.gpus_file.write_text(yaml.safe_dump(described, sort_keys=False))
    lay.gpus_file.chmod(0o644)
    realruntime.write_stub_spec(lay.root, [str(g["uuid"]) for g in gpus])
    record["shared_state"] = realruntime.share_state_dir()
    _save_record(lay, record)

    # containerd makes its k8s.io cgroup at its first container; the chart's plugin mounts it
    # (devicePlugin.hostPaths.podCgroups) and may well be that first container
    pod_cgroups().mkdir(exist_ok=True)
    progress(f"real node: starting the kubelet as {NAME}")
    sandbox.kubectl(
        "create",
        "clusterrolebinding",
        "vgpu-sandbox-real-node",
        "--clusterrole=system:node",
        f"--user=system:node:{NAME}",
    )
    _make_bridge()
    assert sandbox.ca is not None
    serving = sandbox.ca.issue("kubelet", [NODE_IP, NAME])
    port, healthz = sandbox.port("kubelet"), sandbox.port("kubelet-healthz")
    config = configs.kubelet_config(
        lay, port, healthz, sandbox.ca.cert_path, (serving.cert, serving.key), spec.dra
    )
    lay.kubelet_config.write_text(yaml.safe_dump(config, sort_keys=False))
    sandbox.launch("kubelet", daemons.kubelet_argv(sandbox, lay), port)
    daemons.wait_kubelet(sandbox, healthz)

    def ready() -> bool:
        node = sandbox.api_get(f"/api/v1/nodes/{NAME}")
        conditions = node.get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    sandbox.wait_for(f"{NAME} to register and be Ready (kubelet)", ready, 120, ["kubelet", "containerd"])
    record["timings"]["containerd_to_ready_s"] = round(time.monotonic() - t0, 1)
    _save_record(lay, record)
    if spec.dra:
        where = "this machine's GPUs (real NVML)" if spec.real_gpu else "the stub driver's cards (fake NVML)"
        progress(f"real node: starting the DRA plugin on {where} for {NAME}")
        realdra.start_plugin(sandbox, spec, NAME, lay.root, lay.kubelet_root, lay.gpus_file)
        return
    if spec.real_gpu:
        progress(f"real node: starting the device plugin on this machine's GPUs (real NVML) for {NAME}")
        realgpu.start_plugin(sandbox, spec, NAME, lay.root)
        return

    ctk = binaries.bin_dir() / "nvidia-ctk"
    chart = values.chart_values(sandbox, spec, lay, sandbox.port(MONITOR_PORT))
    if spec.sharing == "mps":  # the plugin's fake MPS tool in a stub driver root (realmps)
        realmps.write_driver_root(lay.root)
        chart = values.merge(chart, realmps.chart_values(lay.root, NAME))
        record["mps_folders"] = realmps.card_folders([str(g["uuid"]) for g in gpus])
        _save_record(lay, record)
    if not spec.local_scheduler:
        chart = values.merge(chart, values.scheduler_values(sandbox))
    inventory_file(sandbox).write_text(
        yaml.safe_dump(values.inventory(sandbox, spec, ctk if ctk.exists() else None, chart), sort_keys=False)
    )


def _make_bridge() -> None:
    """The pods' bridge with the node's address on it; the CNI bridge plugin adopts it.

    A kernel without bridges (some micro-VMs) gets the node's address on the loopback device
    instead: the kubelet still has its address, and host-network pods (what a real-GPU node's
    tests run) need no bridge; pods on the pod network cannot start there."""
    ip = ["ip"]
    if subprocess.run([*ip, "link", "show", BRIDGE], capture_output=True).returncode != 0:
        made = subprocess.run([*ip, "link", "add", BRIDGE, "type", "bridge"], capture_output=True, text=True)
        if made.returncode != 0:
            steps = [[*ip, "addr", "add", f"{NODE_IP}/32", "dev", "lo"]]
        else:
            steps = [
                [*ip, "addr", "add", f"{NODE_IP}/{POD_SUBNET.split('/')[1]}", "dev", BRIDGE],
                [*ip, "link", "set", BRIDGE, "up"],
            ]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                raise SandboxError(f"{' '.join(step)} failed: {done.stderr.strip()}")


def restart(sandbox: Handle, component: str) -> float:
    """Stop one of the node's daemons and start it again with the same command line; seconds taken."""
    if component not in COMPONENTS:
        raise SandboxError(f"unknown component {component!r}; restart one of {', '.join(COMPONENTS)}")
    state = sandbox.state()
    if state is None:
        raise SandboxError(f"no sandbox in {sandbox.state_dir}")
    found = [c for c in state.components if c.name == component]
    if not found:
        raise SandboxError(f"this sandbox has no {component}; start it with `vgpu sandbox up --real-node`")
    lay = layout_of(sandbox)
    start_t = time.monotonic()
    old = found[-1]
    procs.stop_all([old.pid], None, grace=20)
    sandbox.adopt(state)
    state.components.remove(old)
    sandbox.launch(component, old.argv, old.port)
    if component == "containerd":
        daemons.wait_containerd(sandbox, lay)
    else:
        daemons.wait_kubelet(sandbox, state.ports["kubelet-healthz"])
    record = _load_record(lay)
    record.setdefault("restarts", {}).setdefault(component, 0)
    record["restarts"][component] += 1
    _save_record(lay, record)
    return time.monotonic() - start_t


def restarts(sandbox: Handle) -> dict[str, int]:
    return dict(_load_record(layout_of(sandbox)).get("restarts") or {})


def unmount_under(root: Path) -> None:
    """Detach every mount at or below ``root``, deepest first (lazily: busy ones go when freed)."""
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if point == str(root) or point.startswith(str(root) + "/"):
                found.append(point)
    for point in sorted(found, key=lambda p: p.count("/"), reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True, timeout=30)


def stop(sandbox: Handle, pids: dict[str, int]) -> None:
    """Take the node down leaving nothing: pods through the CRI, daemons, mounts, bridge, host paths.

    ``pids`` maps the node's components to their recorded pids. Runs before the sandbox's other
    processes are stopped; every step is attempted even when an earlier one failed.
    """
    lay = layout_of(sandbox)
    if not lay.root.exists():
        return
    record = _load_record(lay)
    if "kubelet" in pids:
        procs.stop_all([pids["kubelet"]], None, grace=10)
    temporary: subprocess.Popen[bytes] | None = None
    if lay.containerd_config.exists() and not socket_answers(lay.containerd_socket):
        # containerd is gone (a crash, a killed sandbox): start it again to remove the pods properly.
        with contextlib.suppress(OSError):
            temporary = subprocess.Popen(
                daemons.containerd_argv(lay),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not socket_answers(lay.containerd_socket):
                time.sleep(0.2)
    if socket_answers(lay.containerd_socket):
        with contextlib.suppress(OSError, subprocess.SubprocessError, SandboxError):
            pods = daemons.crictl(lay, "pods", "--quiet").stdout.split()
            if pods:
                daemons.crictl(lay, "stopp", *pods)
                daemons.crictl(lay, "rmp", "--force", *pods)
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            for task in daemons.ctr(lay, "tasks", "list", "--quiet", timeout=30).stdout.split():
                daemons.ctr(lay, "tasks", "kill", "--all", "--signal=SIGKILL", task, timeout=30)
                daemons.ctr(lay, "tasks", "delete", "--force", task, timeout=30)
    if "containerd" in pids:
        procs.stop_all([pids["containerd"]], None, grace=10)
    with contextlib.suppress(OSError):
        realdra.forget_specs(lay.root)  # DRA mode: the specs of claims the kubelet left prepared
    if temporary is not None:
        procs.stop_group(temporary, grace=10)
    shims = daemons.shims_of(lay)
    if shims:
        procs.stop_all(shims, None, grace=5)
    unmount_under(lay.root)
    realruntime.remove_stub_spec()
    realmps.forget(record.get("mps_folders") or [])
    if record.get("shared_state"):  # the containers' tmpfs folders and the shared bind under them
        unmount_under(realruntime.STATE_DIR)
    subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True, timeout=30)
    subprocess.run(["ip", "addr", "del", f"{NODE_IP}/32", "dev", "lo"], capture_output=True, timeout=30)
    for created in record.get("created", []):
        unmount_under(Path(created))
        shutil.rmtree(created, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        # Our kubelet's registration socket, when /var/lib/kubelet was there before us.
        (HOST_PLUGIN_DIR / "kubelet.sock").unlink()
    shutil.rmtree(lay.root, ignore_errors=True)
