"""Figures for the sandbox's real node: how long it takes to come up, and what our path adds to
a pod's start on a real kubelet.

Run (as root, after `make setup`): .venv/bin/python bench/bench_real_node.py [--pods 5]
Prints one line per figure; asserts nothing. Where a real node cannot run here it prints why and
exits 0.

1. `vgpu sandbox up --real-node` (one KWOK node): total seconds, and of them containerd to node
   Ready and the images' import.
2. `ansible-playbook site.yml` with the generated inventory: the role on the real node and the
   chart, until the device-plugin pod is ready.
3. Pod start on the real node, created one after another, timed from create to the container's
   first output line: pods asking for a vGPU (webhook, the extender's filter and bind, the real
   kubelet's Allocate, the hook preloaded) against the same pod asking for none (the default
   kube-scheduler, no Allocate, no hook).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vgpu_sandbox.cluster import Sandbox, Spec
from vgpu_sandbox.realnode import layout, prechecks, sample

ROOT = Path(__file__).resolve().parents[1]


def _pod(name: str, gpu: bool) -> dict[str, Any]:
    command = "t_alloc link alloc 256 >/dev/null; echo started; sleep 3600"
    limits = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"} if gpu else None
    return sample.sample_pod(name, command, limits, 8192)


def _start_time(sandbox: Sandbox, name: str, gpu: bool) -> float:
    start = time.monotonic()
    sandbox.kubectl("apply", "-f", "-", input=json.dumps(_pod(name, gpu)))
    while time.monotonic() - start < 120:
        if "started" in sandbox.kubectl("logs", name, check=False).stdout:
            elapsed = time.monotonic() - start
            sandbox.kubectl("delete", "pod", name, "--wait=true", "--grace-period=0", timeout=120)
            return elapsed
        time.sleep(0.05)
    raise SystemExit(f"{name} did not start within 120 s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=5)
    args = parser.parse_args()
    reason = prechecks.why_not()
    if reason:
        print(f"bench_real_node: skipped: {reason}")
        return 0
    state_dir = Path(tempfile.mkdtemp(prefix="vgpu-bn-", dir="/tmp"))
    sandbox = Sandbox(state_dir)
    try:
        up = sandbox.up(Spec(nodes=1, gpus_per_node=2, gpu_memory_mib=8192, split=8, real_node=True))
        timings = json.loads((layout.layout_of(sandbox).record).read_text())["timings"]
        print(
            f"sandbox up --real-node: {up:.1f} s (containerd to node Ready "
            f"{timings['containerd_to_ready_s']} s, of which importing the images "
            f"{timings['images_import_s']} s)"
        )
        env = dict(os.environ, KUBECONFIG=str(sandbox.kubeconfig))
        started = time.monotonic()
        play = subprocess.run(
            [
                str(Path(sys.executable).with_name("ansible-playbook")),
                "-i",
                str(layout.inventory_file(sandbox)),
                str(ROOT / "playbooks" / "site.yml"),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        if play.returncode != 0:
            print(play.stdout[-3000:])
            return 1
        took = time.monotonic() - started
        print(f"ansible-playbook site.yml (role on the real node, chart, plugin pod ready): {took:.1f} s")
        # The plugin must have registered before a vGPU pod can be admitted by the kubelet.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            node = json.loads(sandbox.kubectl("get", "node", layout.NAME, "-o", "json").stdout)
            if int(node["status"]["allocatable"].get("nvidia.com/gpu", "0")) > 0:
                break
            time.sleep(0.5)
        for gpu in (False, True):
            times = [
                _start_time(sandbox, f"bench-{'gpu' if gpu else 'plain'}-{i}", gpu) for i in range(args.pods)
            ]
            what = (
                "asking for a vGPU (extender, Allocate, hook)"
                if gpu
                else "asking for no GPU (default scheduler)"
            )
            print(
                f"pod start, create to first output, {what}: median {statistics.median(times):.2f} s, "
                f"min {min(times):.2f}, max {max(times):.2f} over {len(times)} pods"
            )
    finally:
        sandbox.down()
        shutil.rmtree(state_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
