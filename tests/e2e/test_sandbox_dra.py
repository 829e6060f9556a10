"""``vgpu sandbox up --real-node --dra`` over the stub driver: the mode tests/gpu/test_dra_gpu.py
runs on a real GPU (with ``--real-gpu``), here on the fake NVML of the stub driver's card.

The sandbox labels its real node for DRA, makes the DeviceClass and runs ``vgpu dra-plugin`` on
the sandbox kubelet's own folders; a pod whose claim asks for 3000Mi and 30 cores runs, is held to
its claim inside (the stub driver's memory refused past 3000 MiB, the context's charge included),
its claim's CDI spec names the grant and the hook, ``vgpu status`` shows the claim, and the spec
goes with the pod; ``examples/dra.yaml``, applied as it is, runs. The sandbox is the one
docs/sandbox.md documents (``vgpu sandbox up --nodes 0 --real-node --dra``: its default cards).
Needs what tests/e2e/test_dra_real_node.py needs (the 1.36 pieces and containerd 2); run it
under the machine's real-node lock.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from vgpu_sandbox import realdra
from vgpu_sandbox.binaries import repo_root
from vgpu_sandbox.cluster import Sandbox, Spec
from vgpu_sandbox.realnode import layout

from tests.e2e.test_dra_real_node import _pod, _why_not
from tests.support import wait_for
from tests.support.groups import REAL_NODE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600), pytest.mark.xdist_group(REAL_NODE)]


@pytest.fixture(scope="module")
def node() -> Iterator[Sandbox]:
    why = _why_not()
    if why:
        pytest.skip(f"no real node with CDI here: {why}")
    top = Path(tempfile.mkdtemp(prefix="vgpu-sbx-dra-", dir="/tmp"))
    sb = Sandbox(top / "sandbox")
    try:
        sb.up(Spec(nodes=0, real_node=True, dra=True))  # as docs/sandbox.md has it
        yield sb
    finally:
        sb.down()
        shutil.rmtree(top, ignore_errors=True)


def test_the_sandbox_in_dra_mode_prepares_a_claim_that_holds_its_container(node: Sandbox) -> None:
    labels = json.loads(node.kubectl("get", "node", layout.NAME, "-o", "json").stdout)["metadata"]["labels"]
    assert labels.get("openaios.io/gpu-mode") == "dra"
    node.kubectl("get", "deviceclass", realdra.DRIVER)
    assert "real-node-0" in node.kubectl("get", "resourceslices", "-o", "name").stdout
    node.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": _pod("sbx-a", "3000Mi", "30")}),
    )

    def logs() -> str:
        return node.kubectl("logs", "-n", "default", "sbx-a", check=False).stdout

    try:
        wait_for(lambda: "holding" in logs(), "sbx-a holding", timeout=180, every=2)
    except AssertionError as err:
        described = node.kubectl("describe", "pod", "-n", "default", "sbx-a", check=False).stdout
        plugin = (node.logs_dir / f"{realdra.COMPONENT}.log").read_text(errors="replace")[-3000:]
        raise AssertionError(f"{err}\n{described[-3000:]}\n--- plugin\n{plugin}") from err
    fields = dict(re.findall(r"^(\w+)=(.*)$", logs(), re.M))
    assert (fields["chunks"], fields["refused"]) == ("9", "2"), logs()  # 640 MiB context + 9 x 256
    claim = json.loads(node.kubectl("get", "resourceclaims", "-n", "default", "-o", "json").stdout)["items"][
        0
    ]
    uid = claim["metadata"]["uid"]
    spec_file = realdra.CDI_DIR / f"{realdra.DRIVER}-claim_{uid}.json"
    edits = json.loads(spec_file.read_text())["devices"][0]["containerEdits"]
    mounts = {m["containerPath"]: m["hostPath"] for m in edits["mounts"]}
    assert mounts["/etc/vgpu/limits"].endswith(f"dra_{uid}_gpu.limits"), mounts
    assert mounts["/etc/vgpu/limits"].startswith(str(realdra.state_dir(layout.layout_of(node).root)))
    assert "/etc/ld.so.preload" in mounts, mounts
    assert "deviceNodes" not in edits  # the stub driver is the image's: no driverInject: plugin
    shown = subprocess.run(
        [sys.executable, "-m", "vgpu.commands.cli", "status", f"--kubeconfig={node.kubeconfig}"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert re.search(r"default/sbx-a claim \S+/gpu\s+3000 MiB\s+cores 30%", shown), shown
    node.kubectl("delete", "pod", "-n", "default", "sbx-a", "--wait=true", "--timeout=60s", timeout=90)
    wait_for(lambda: not spec_file.exists(), "the claim's CDI spec gone", timeout=60, every=1)


def test_the_dra_example_runs_as_shipped_on_the_documented_sandbox(node: Sandbox) -> None:
    """Issue 37: examples/dra.yaml stayed Pending here (the node's taints untolerated, an image this
    machine cannot pull, a template for an H200). Applied unchanged, each of its pods runs."""
    example = repo_root() / "examples" / "dra.yaml"
    pods = [d["metadata"]["name"] for d in yaml.safe_load_all(example.read_text()) if d["kind"] == "Pod"]
    assert len(pods) == 3
    node.kubectl("apply", "-f", str(example))

    def phases() -> dict[str, str]:
        listed = json.loads(node.kubectl("get", "pods", "-n", "default", "-o", "json").stdout)["items"]
        return {
            p["metadata"]["name"]: p["status"].get("phase", "")
            for p in listed
            if p["metadata"]["name"] in pods
        }

    try:
        try:
            wait_for(
                lambda: set(phases().values()) == {"Running"} and len(phases()) == 3,
                "the example's pods",
                timeout=180,
                every=2,
            )
        except AssertionError as err:
            described = node.kubectl("describe", "pods", "-n", "default", *pods, check=False).stdout
            raise AssertionError(f"{err}: {phases()}\n{described[-4000:]}") from err
        claims = json.loads(node.kubectl("get", "resourceclaims", "-n", "default", "-o", "json").stdout)[
            "items"
        ]
        consumed = sorted(
            (r["consumedCapacity"]["memory"], r["consumedCapacity"]["cores"])
            for c in claims
            if any(o["name"] in pods for o in c["metadata"].get("ownerReferences") or [])
            for r in c["status"]["allocation"]["devices"]["results"]
        )
        assert consumed == [("3000Mi", "30"), ("8000Mi", "50"), ("80Gi", "100")], consumed  # 81920Mi
    finally:
        node.kubectl("delete", "-f", str(example), "--wait=true", "--timeout=120s", timeout=150, check=False)
