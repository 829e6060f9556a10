"""`make demo`: the sandbox, the playbook, sample vGPU pods placed and shown.

Starts the sandbox (or reuses the one running), runs
``ansible-playbook -i inventory/sandbox.yml playbooks/site.yml`` against it, applies
``examples/pods.yaml`` and prints, for each pod, where it landed and with what limits.
The sandbox stays up afterwards so it can be explored; ``vgpu sandbox down`` stops it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from vgpu.core.annotations import (
    ALLOCATION_ANNOTATION,
    PHASE_ANNOTATION,
    REASON_ANNOTATION,
    decode_allocation,
)
from vgpu.core.errors import AnnotationError
from vgpu.core.output import run_command
from vgpu.core.requests import RESOURCE_GPU, RESOURCE_MEM
from vgpu.hookabi.grant import DEFAULT_CONTEXT_RESERVE
from vgpu_sandbox.binaries import repo_root
from vgpu_sandbox.cluster import Sandbox, Spec
from vgpu_sandbox.errors import SandboxError


def say(message: str) -> None:
    print(f"\n=== {message}", flush=True)


def run_playbook(sandbox: Sandbox, root: Path, inventory: Path | None = None) -> None:
    playbook = root / "playbooks" / "site.yml"
    inventory = inventory or root / "inventory" / "sandbox.yml"
    binary = Path(sys.executable).parent / "ansible-playbook"
    if not playbook.exists() or not inventory.exists():
        raise SandboxError(f"{playbook} or {inventory} is missing; this checkout has no playbook to run")
    if not binary.exists():
        found = shutil.which("ansible-playbook")
        if found is None:
            raise SandboxError("ansible-playbook is not installed; run `make setup`")
        binary = Path(found)
    shown = inventory.relative_to(root) if inventory.is_relative_to(root) else inventory
    say(f"ansible-playbook -i {shown} {playbook.relative_to(root)}")
    env = {
        **os.environ,
        "KUBECONFIG": str(sandbox.kubeconfig),
        "PATH": f"{sandbox.bin('kubectl').parent}:{os.environ.get('PATH', '')}",
        "ANSIBLE_FORCE_COLOR": "0",
    }
    result = subprocess.run([str(binary), "-i", str(inventory), str(playbook)], cwd=root, env=env)
    if result.returncode != 0:
        raise SandboxError(f"the playbook failed (exit {result.returncode}); its output is above")


def wait_placed(sandbox: Sandbox, names: list[str], timeout: float = 120) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    pods: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        listed = json.loads(sandbox.kubectl("get", "pods", "-n", "default", "-o", "json").stdout)["items"]
        pods = [p for p in listed if p["metadata"]["name"] in names]
        settled = [
            p
            for p in pods
            if (p["metadata"].get("annotations") or {}).get(PHASE_ANNOTATION) in ("allocated", "failed")
            or p["status"].get("phase") == "Running"
        ]
        if len(settled) == len(names):
            break
        time.sleep(1)
    return pods


def show(pods: list[dict[str, Any]]) -> None:
    say("where each pod landed, and with what limits")
    header = (
        f"{'POD':<24} {'NODE':<13} {'PHASE':<10} {'CONTAINER':<10} {'GPU':<42} {'MEMORY':>9} {'CORES':>6}"
    )
    print(header)
    print("-" * len(header))
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        name = pod["metadata"]["name"]
        annotations = pod["metadata"].get("annotations") or {}
        node = pod["spec"].get("nodeName") or "-"
        phase = annotations.get(PHASE_ANNOTATION) or pod["status"].get("phase", "?")
        try:
            allocation = decode_allocation(annotations.get(ALLOCATION_ANNOTATION))
        except AnnotationError as err:
            reason = annotations.get(REASON_ANNOTATION) or str(err)
            print(f"{name:<24} {node:<13} {phase:<10} {'-':<10} {'(no allocation: ' + reason[:60] + ')'}")
            continue
        for container in allocation.containers:
            for device in container.devices:
                print(
                    f"{name:<24} {node:<13} {phase:<10} {container.name:<10} {device.uuid:<42} "
                    f"{device.memory_mib:>6}MiB {device.cores:>5}%"
                )


REAL_NODE_POD = "real-node-cuda"
# The real node's pod: a grant of LIMIT_MIB, filled CHUNK_MIB at a time, then HOLD_MIB held.
LIMIT_MIB, CHUNK_MIB, HOLD_MIB = 3000, 256, 1024
CU_RESULTS = {0: "CUDA_SUCCESS", 2: "CUDA_ERROR_OUT_OF_MEMORY"}


def explain(logs: str) -> list[str]:
    """What each value the real node's pod printed means, in the numbers it printed.

    The CUDA context's charge is the grant's (the device plugin writes the hook's default,
    ``DEFAULT_CONTEXT_RESERVE``): each process pays it once, before its first allocation.
    """
    values = dict(re.findall(r"(\w+)=(\S*)", logs))
    context = DEFAULT_CONTEXT_RESERVE >> 20
    said = []
    if "limit" in values:
        said.append(
            f"limit={values['limit']}: the container's grant, {LIMIT_MIB} MiB (nvidia.com/gpumem), held by "
            "libvgpu.so, which /etc/ld.so.preload loads into every process of the container"
        )
    chunks = int(values["chunks"]) if values.get("chunks", "").isdigit() else None
    if chunks is not None:
        said.append(
            f"chunks={chunks}: t_alloc got {chunks} x {CHUNK_MIB} MiB = {chunks * CHUNK_MIB} MiB; with the "
            f"{context} MiB the hook charges a process for its CUDA context (the grant's context reserve, "
            f"docs/hook.md), {context + chunks * CHUNK_MIB} of the {LIMIT_MIB} MiB"
        )
    for key in ("refused", "held"):
        if not values.get(key, "").isdigit():
            continue
        code = int(values[key])
        result = f"{CU_RESULTS.get(code, 'CUresult')} ({code}, a CUDA result code, not MiB)"
        if key == "refused" and chunks is not None:
            said.append(
                f"refused={code}: chunk {chunks + 1} would have made "
                f"{context + (chunks + 1) * CHUNK_MIB} MiB, past the {LIMIT_MIB}: the hook answered "
                f"{result} without asking the driver"
            )
        elif key == "held":
            kept = (
                f"it keeps them, with its own {context} MiB context, so vgpu status below shows the "
                f"container using {HOLD_MIB + context} MiB"
                if code == 0
                else "it holds nothing"
            )
            said.append(f"held={code}: t_hold's cuMemAlloc of {HOLD_MIB} MiB returned {result}; {kept}")
    return said


def run_on_the_real_node(sandbox: Sandbox) -> None:
    """A pod from the sample image on the real node: its limits, the hook's refusal, its logs."""
    from vgpu_sandbox.realnode import layout, sample

    command = (
        "echo limit=$CUDA_DEVICE_MEMORY_LIMIT_0 preload=$(cat /etc/ld.so.preload); "
        f"t_alloc link alloc {CHUNK_MIB} | grep -E 'chunks|refused'; sleep infinity | t_hold {HOLD_MIB}"
    )
    limits = {RESOURCE_GPU: "1", RESOURCE_MEM: str(LIMIT_MIB)}
    pod = sample.sample_pod(REAL_NODE_POD, command, limits, Spec().gpu_memory_mib)
    say(
        f"a pod on the real node {layout.NAME}: the sample image, {LIMIT_MIB} MiB, "
        f"filled {CHUNK_MIB} at a time"
    )
    sandbox.kubectl("delete", "pod", REAL_NODE_POD, "--ignore-not-found", "--wait=true", check=False)
    sandbox.kubectl("apply", "-f", "-", input=json.dumps(pod))
    deadline = time.monotonic() + 120
    logs = ""
    while time.monotonic() < deadline and "held=" not in logs:
        logs = sandbox.kubectl("logs", REAL_NODE_POD, check=False).stdout
        time.sleep(1)
    print(f"$ kubectl logs {REAL_NODE_POD}")
    print(logs.rstrip() or "(no output yet: kubectl describe pod real-node-cuda)")
    for line in explain(logs):
        print(textwrap.fill(line, 108, initial_indent="  ", subsequent_indent="      "))
    time.sleep(11)  # the node's Lease carries the usage, renewed every 10 s


def describe(sandbox: Sandbox) -> str:
    """What the running sandbox is, in a few words: its nodes, whether it has the real node."""
    state = sandbox.state()
    if state is None:
        return "no state"
    real = "and the real node real-node-0" if state.spec.real_node else "no real node"
    return f"{state.spec.nodes} KWOK nodes, {real}"


def reuse_refusal(sandbox: Sandbox, real_node: bool) -> str:
    """Why the running sandbox cannot serve this demo, or "" when it can.

    ``make demo REAL_NODE=1`` needs a sandbox with the real node; reusing one without it would
    show no pod on a real node and still exit 0. It is not restarted behind the person's back
    (it may hold their own pods): they are told how to."""
    state = sandbox.state()
    if real_node and (state is None or not state.spec.real_node):
        return (
            f"REAL_NODE=1 needs a sandbox with the real node, but the one running from {sandbox.state_dir} "
            f"has none ({describe(sandbox)}); stop it with `.venv/bin/vgpu sandbox down`, "
            "then run `make demo REAL_NODE=1` again"
        )
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make demo", description=__doc__)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--skip-playbook", action="store_true", help="do not run ansible-playbook")
    parser.add_argument(
        "--real-node",
        action="store_true",
        help="also run a real node (kubelet, containerd, runc; root) and a pod on it (docs/sandbox.md)",
    )
    args = parser.parse_args(argv)
    root = repo_root()
    sandbox = Sandbox()
    try:
        if sandbox.is_running() and sandbox.status().get("healthy"):
            refusal = reuse_refusal(sandbox, args.real_node)
            if refusal:
                raise SandboxError(refusal)
            say(f"reusing the sandbox running from {sandbox.state_dir} ({describe(sandbox)})")
        else:
            if sandbox.is_running():
                say("the sandbox is degraded; restarting it")
                sandbox.down()
            say(f"vgpu sandbox up --nodes {args.nodes}{' --real-node' if args.real_node else ''}")
            spec = Spec(nodes=args.nodes, real_node=args.real_node)
            seconds = sandbox.up(spec, progress=lambda m: print(f"  {m}", flush=True))
            print(f"  up in {seconds:.1f}s")
        print(sandbox.kubectl("get", "nodes", "-L", "gpu").stdout)
        state = sandbox.state()
        has_real_node = state is not None and state.spec.real_node
        if not args.skip_playbook:
            inventory = sandbox.state_dir / "inventory.yml" if has_real_node else None
            run_playbook(sandbox, root, inventory)
        say("kubectl apply -f examples/pods.yaml")
        manifest = (root / "examples" / "pods.yaml").read_text()
        sandbox.kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=true", input=manifest, check=False)
        print(sandbox.kubectl("apply", "-f", "-", input=manifest).stdout)
        names = [
            line.split(":", 1)[1].strip() for line in manifest.splitlines() if line.startswith("  name:")
        ]
        show(wait_placed(sandbox, names))
        if has_real_node:
            run_on_the_real_node(sandbox)
        status = Path(sys.executable).parent / "vgpu"
        if status.exists():
            say("vgpu status: per node and card, which container got what")
            subprocess.run([str(status), "status", f"--kubeconfig={sandbox.kubeconfig}"], check=False)
    except SandboxError as err:
        print(f"make demo: error: {err}", file=sys.stderr)
        return 1
    say("the sandbox keeps running")
    print(f"  export KUBECONFIG={sandbox.kubeconfig}")
    print("  .venv/bin/vgpu sandbox status      # what runs")
    print("  .venv/bin/vgpu sandbox down        # stop everything")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
