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
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vgpu.annotations import ALLOCATION_ANNOTATION, PHASE_ANNOTATION, REASON_ANNOTATION, decode_allocation
from vgpu.errors import AnnotationError
from vgpu.sandbox.binaries import repo_root
from vgpu.sandbox.cluster import Sandbox, Spec
from vgpu.sandbox.errors import SandboxError


def say(message: str) -> None:
    print(f"\n=== {message}", flush=True)


def run_playbook(sandbox: Sandbox, root: Path) -> None:
    playbook = root / "playbooks" / "site.yml"
    inventory = root / "inventory" / "sandbox.yml"
    binary = Path(sys.executable).parent / "ansible-playbook"
    if not playbook.exists() or not inventory.exists():
        raise SandboxError(f"{playbook} or {inventory} is missing; this checkout has no playbook to run")
    if not binary.exists():
        found = shutil.which("ansible-playbook")
        if found is None:
            raise SandboxError("ansible-playbook is not installed; run `make setup`")
        binary = Path(found)
    say(f"ansible-playbook -i {inventory.relative_to(root)} {playbook.relative_to(root)}")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make demo", description=__doc__)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--skip-playbook", action="store_true", help="do not run ansible-playbook")
    args = parser.parse_args(argv)
    root = repo_root()
    sandbox = Sandbox()
    try:
        if sandbox.is_running() and sandbox.status().get("healthy"):
            say(f"reusing the sandbox running from {sandbox.state_dir}")
        else:
            if sandbox.is_running():
                say("the sandbox is degraded; restarting it")
                sandbox.down()
            say(f"vgpu sandbox up --nodes {args.nodes}")
            seconds = sandbox.up(Spec(nodes=args.nodes), progress=lambda m: print(f"  {m}", flush=True))
            print(f"  up in {seconds:.1f}s")
        print(sandbox.kubectl("get", "nodes", "-L", "gpu").stdout)
        if not args.skip_playbook:
            run_playbook(sandbox, root)
        say("kubectl apply -f examples/pods.yaml")
        manifest = (root / "examples" / "pods.yaml").read_text()
        sandbox.kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=true", input=manifest, check=False)
        print(sandbox.kubectl("apply", "-f", "-", input=manifest).stdout)
        names = [
            line.split(":", 1)[1].strip() for line in manifest.splitlines() if line.startswith("  name:")
        ]
        show(wait_placed(sandbox, names))
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
    sys.exit(main())
