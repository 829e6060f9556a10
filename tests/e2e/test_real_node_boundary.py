"""The tenant boundary on the real node (docs/security.md): the upstream kubelet, containerd 2 and
runc, with NVIDIA's container runtime (built from its Go modules) as containerd's default runtime
in CDI mode, and the stub driver's two cards as the node's CDI spec (vgpu_sandbox.realruntime),
each of which mounts a marker at /run/vgpu-stub/cards/<uuid>: a container lists what it got.

- a pod that asks for no vGPU and sets ``NVIDIA_VISIBLE_DEVICES=all`` (as every nvidia/cuda image
  does), or a ``cdi.k8s.io/`` annotation, gets no card; the same pod with the toolkit set as the
  role left it before (the variable accepted) gets both, so the runtime is in the path;
- a vGPU pod that sets the variable gets its own card alone, and its writable folder is a small
  tmpfs that runs nothing;
- a placement a tenant writes is refused, and one that got past admission is refused by the node;
- the device plugin's own token, minted for its pod, writes its own node only.

Needs what test_real_node.py needs; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vgpu_sandbox import binaries, realruntime
from vgpu_sandbox.cluster import Spec
from vgpu_sandbox.realnode import layout, sample

from tests.e2e import test_real_node as real_node
from tests.e2e.test_real_node import _plugin_running
from tests.support import container, pod, wait_for
from tests.support.groups import REAL_NODE
from tests.support.sandboxes import real_node_sandbox
from tests.support.tenant import AS_SCHEDULER, Tenant, as_kubeconfig, refused_by, token_kubeconfig
from vgpu.core import annotations as ann

NODE = layout.NAME
CARD_MIB = 8192
NAMESPACE = "kube-system"
CARDS = realruntime.CARDS_IN_CONTAINER
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900), pytest.mark.xdist_group(REAL_NODE)]
_FLAKY = (subprocess.SubprocessError, OSError, ValueError, KeyError)


def _log(message: str) -> None:
    print(f"[real-node-boundary {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Node(real_node.Node):
    """test_real_node's node, with what a tenant's pods are checked by."""

    def cards(self) -> list[str]:
        raw = self.get("node", NODE)["metadata"]["annotations"][ann.DEVICES_ANNOTATION]
        return sorted(d.uuid for d in ann.decode_devices(raw).devices)

    def run(
        self,
        name: str,
        command: str,
        limits: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
    ) -> tuple[dict[str, Any], str]:
        """A sample pod on the real node running ``command`` to its end: (the pod, its log)."""
        manifest = sample.sample_pod(name, command, limits, CARD_MIB)
        manifest["spec"]["containers"][0]["env"] += [{"name": k, "value": v} for k, v in (env or {}).items()]
        if annotations:
            manifest["metadata"]["annotations"] = annotations
        self.sandbox.kubectl("apply", "-f", "-", input=json.dumps(manifest))

        def ended() -> dict[str, Any] | None:
            pod = self.get("pod", "-n", "default", name)
            return pod if pod["status"].get("phase") in ("Succeeded", "Failed") else None

        pod = wait_for(ended, f"pod {name} to run to its end", 120, every=1.0, ignore=_FLAKY)
        logs = self.sandbox.kubectl("logs", "-n", "default", name, check=False).stdout
        self.sandbox.kubectl("delete", "pod", "-n", "default", name, "--wait=false", check=False)
        _log(f"{name}: {pod['status']['phase']}: {logs.strip()[:400]!r}")
        return pod, logs

    def toolkit(self, accept_env: bool) -> None:
        """The toolkit's config as the role leaves it (False), or as it was before (True)."""
        ctk = binaries.bin_dir() / "nvidia-ctk"
        subprocess.run(
            [str(ctk), "config", "--in-place", f"--config-file={realruntime.toolkit_config(self.lay.root)}",
             "--set", f"accept-nvidia-visible-devices-envvar-when-unprivileged={str(accept_env).lower()}"],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip


LIST = f"ls {CARDS} 2>/dev/null | sort | tr '\\n' ' '; echo; echo listed"


def _listed(logs: str) -> list[str]:
    lines = logs.splitlines()
    return lines[lines.index("listed") - 1].split() if "listed" in lines else ["<no listing>"]


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    with real_node_sandbox("vgpu-rb-") as sandbox:
        spec = Spec(nodes=1, gpus_per_node=2, gpu_memory_mib=CARD_MIB, split=4, real_node=True)
        _log(f"vgpu sandbox up --real-node: {sandbox.up(spec, progress=_log):.1f}s")
        n = Node(sandbox)
        result = n.play()
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
        wait_for(
            lambda: _plugin_running(n),
            "the chart's device plugin on the real node",
            180,
            every=1.0,
            ignore=_FLAKY,
        )
        yield n


def test_the_role_makes_nvidias_runtime_the_default_and_refuses_a_containers_own_variable(node: Node) -> None:
    config = node.lay.containerd_config.read_text()
    assert f'BinaryName = "{realruntime.runtime_binary()}"' in config
    assert 'default_runtime_name = "nvidia"' in config
    toolkit = realruntime.toolkit_config(node.lay.root).read_text()
    assert "accept-nvidia-visible-devices-envvar-when-unprivileged = false" in toolkit
    assert "accept-nvidia-visible-devices-as-volume-mounts = true" in toolkit
    assert 'mode = "cdi"' in toolkit


def test_a_pod_asking_for_no_vgpu_gets_no_card_whatever_its_environment_or_annotations_say(
    node: Node,
) -> None:
    cards = node.cards()
    assert len(cards) == 2
    # the control: the toolkit as the role left it before accepts the variable, and NVIDIA's
    # runtime, in the path, hands the pod every card
    node.toolkit(accept_env=True)
    try:
        _, before = node.run("env-all-before", LIST, env={"NVIDIA_VISIBLE_DEVICES": "all"})
    finally:
        node.toolkit(accept_env=False)
    assert _listed(before) == cards
    _, after = node.run("env-all", LIST, env={"NVIDIA_VISIBLE_DEVICES": "all"})
    assert _listed(after) == []
    _, annotated = node.run(
        "cdi-annotation", LIST, annotations={"cdi.k8s.io/mine": f"{realruntime.CDI_KIND}=all"}
    )
    assert _listed(annotated) == []


FOLDER_CHECK = (
    'dir=$(dirname "$CUDA_DEVICE_MEMORY_SHARED_CACHE"); '
    'echo "mount: $(grep " $dir " /proc/self/mountinfo)"; '
    "dd if=/dev/zero of=$dir/fill bs=1M count=8 2>&1 | grep -v records; rm -f $dir/fill; "
    "cp /bin/true $dir/tool && chmod 755 $dir/tool && $dir/tool; echo ran=$?; rm -f $dir/tool; "
)


def test_a_vgpu_pod_that_sets_the_variable_gets_its_own_card_alone_and_a_folder_that_runs_nothing(
    node: Node,
) -> None:
    pod, logs = node.run(
        "own-card",
        FOLDER_CHECK + LIST,
        {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"},
        env={"NVIDIA_VISIBLE_DEVICES": "all"},
    )
    allocation = ann.decode_allocation(pod["metadata"]["annotations"][ann.ALLOCATION_ANNOTATION])
    assert _listed(logs) == [allocation.containers[0].devices[0].uuid]
    # its writable folder: a tmpfs of its own, nosuid,nodev,noexec, 1 MiB
    fields = next(line for line in logs.splitlines() if line.startswith("mount: ")).split()[1:]
    assert fields[fields.index("-") + 1] == "tmpfs", fields
    assert {"nosuid", "nodev", "noexec"} <= set(fields[5].split(",")), fields
    assert "size=1024k" in fields[-1], fields
    assert "No space left on device" in logs
    assert "ran=126" in logs  # exec refused: Permission denied


def test_a_tenants_placement_is_refused_and_one_past_admission_is_refused_by_the_node(node: Node) -> None:
    tenant = Tenant(node.sandbox, "tenant-rn")
    tenant.create()
    try:
        card = node.cards()[0]
        allocation = ann.Allocation(
            NODE, (ann.ContainerAllocation("cuda", (ann.DeviceAllocation(card, 0, 0),)),)
        )
        forged = sample.sample_pod(
            "forged", LIST, {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"}, CARD_MIB
        )
        forged["metadata"] = {
            "name": "forged",
            "namespace": tenant.namespace,
            "annotations": {
                ann.ALLOCATION_ANNOTATION: ann.encode_allocation(allocation),
                ann.PHASE_ANNOTATION: ann.PHASE_BOUND,
            },
        }
        forged["spec"]["nodeName"] = NODE
        refused_by(tenant.apply(forged), "placements")
        # past admission (the scheduler's own account): the real kubelet asks the plugin, which refuses
        made = node.sandbox.kubectl(*AS_SCHEDULER, "create", "-f", "-", input=json.dumps(forged), check=False)
        assert made.returncode == 0, made.stderr

        def failed() -> dict[str, Any] | None:
            pod = node.get("pod", "-n", tenant.namespace, "forged")
            return pod if pod["status"].get("phase") == "Failed" else None

        pod = wait_for(failed, "the kubelet to fail the forged pod", 120, every=1.0, ignore=_FLAKY)
        assert pod["status"]["reason"] == "UnexpectedAdmissionError"
        assert "is given 0 MiB on card" in pod["status"]["message"], pod["status"]
        events = node.get("events", "-n", tenant.namespace, "--field-selector=involvedObject.name=forged")
        assert [e for e in events["items"] if e["reason"] == "VgpuPlacementRefused"]
        _log(f"forged pod past admission: {pod['status']['message'][:300]}")
    finally:
        tenant.delete()


def test_the_real_plugins_own_token_writes_its_own_node_alone(node: Node, tmp_path: Path) -> None:
    plugin = node.plugin_pod()
    assert plugin is not None
    token = node.sandbox.kubectl(
        "create", "token", "vgpu-device-plugin", "-n", NAMESPACE, "--bound-object-kind=Pod",
        f"--bound-object-name={plugin['metadata']['name']}",
    ).stdout.strip()  # fmt: skip
    kubeconfig = token_kubeconfig(node.sandbox, token, tmp_path / "plugin.kubeconfig")
    # a pod on a KWOK node, placed by the scheduler
    elsewhere_pod = pod("elsewhere", container(gpu=1, gpumem=1000))
    node.sandbox.kubectl("apply", "-f", "-", input=json.dumps(elsewhere_pod))
    try:
        elsewhere = wait_for(
            lambda: (p := node.get("pod", "-n", "default", "elsewhere"))["spec"].get("nodeName") and p,
            "the scheduler to place the pod on a KWOK node",
            60,
            every=0.5,
            ignore=_FLAKY,
        )
        other = elsewhere["spec"]["nodeName"]
        assert other != NODE
        phase = as_kubeconfig(
            node.sandbox, kubeconfig, "annotate", "--overwrite", "pod", "elsewhere", "-n", "default",
            f"{ann.PHASE_ANNOTATION}={ann.PHASE_FAILED}",
        )  # fmt: skip
        assert f"of node {NODE} may write" in refused_by(phase, "placements", "node-agent-pods")
        inventory = as_kubeconfig(node.sandbox, kubeconfig, "annotate", "--overwrite", "node", other, "x=y")
        refused_by(inventory, "node-agent-nodes")
        mine = as_kubeconfig(
            node.sandbox, kubeconfig, "annotate", "--overwrite", "node", NODE, "vgpu.openaios.io/probe=1"
        )
        assert mine.returncode == 0, mine.stderr
    finally:
        node.sandbox.kubectl("delete", "pod", "-n", "default", "elsewhere", "--wait=false", check=False)
