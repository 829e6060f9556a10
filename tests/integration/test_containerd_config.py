"""The real node's containerd configuration read by the real containerd 2 and changed by NVIDIA's
real nvidia-ctk, as roles/gpu_node runs it (``nvidia-ctk runtime configure --runtime=containerd
--config=...``): the sandbox's config version 3 with CDI, the nvidia runtime merged into containerd
2's layout (``io.containerd.cri.v1.runtime``) with everything of ours kept, and a second run that
changes nothing (the role restarts containerd only when the file's checksum changed).

Needs containerd and nvidia-ctk built into VGPU_BIN_DIR (``tools/build.sh containerd nvidia-ctk``);
starts no daemon: ``containerd config dump`` loads and migrates the file as containerd's start does.
"""

from __future__ import annotations

import hashlib
import subprocess
import tomllib
from pathlib import Path

import pytest
from vgpu_sandbox import binaries
from vgpu_sandbox.realnode import configs, layout

CTK = binaries.bin_dir() / "nvidia-ctk"
CONTAINERD = binaries.bin_dir() / "containerd"

pytestmark = pytest.mark.skipif(
    not (CTK.exists() and CONTAINERD.exists()),
    reason=f"containerd or nvidia-ctk not built in {binaries.bin_dir()}: run tools/build.sh containerd "
    "nvidia-ctk",
)


def _configure(config: Path) -> subprocess.CompletedProcess[str]:
    # roles/gpu_node/tasks/configure-containerd.yml's argv (gpu_node_nvidia_runtime_default false)
    return subprocess.run(
        [str(CTK), "runtime", "configure", "--runtime=containerd", f"--config={config}"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _dump(config: Path) -> dict:  # type: ignore[type-arg]
    done = subprocess.run(
        [str(CONTAINERD), f"--config={config}", "config", "dump"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return tomllib.loads(done.stdout)


def test_nvidia_ctk_merges_its_runtime_into_containerd_2s_config_and_containerd_reads_it(
    tmp_path: Path,
) -> None:
    lay = layout.NodeLayout(tmp_path / "node")
    config = tmp_path / "containerd.toml"
    config.write_text(configs.containerd_config(lay, "registry.k8s.io/pause:3.10", Path("/usr/lib/cni")))
    assert _dump(config)["plugins"]["io.containerd.cri.v1.runtime"]["enable_cdi"] is True

    first = _configure(config)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "io.containerd.cri.v1.runtime" in first.stderr, "nvidia-ctk did not take the file as version 3"
    written = tomllib.loads(config.read_text())
    assert written["version"] == 3
    runtimes = written["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]
    assert runtimes["nvidia"]["options"]["BinaryName"] == "/usr/bin/nvidia-container-runtime"
    # The nvidia runtime is runc's copy: our shim, our runc root; runc stays the default.
    assert runtimes["nvidia"]["runtime_path"] == runtimes["runc"]["runtime_path"]
    assert runtimes["nvidia"]["options"]["Root"] == str(lay.runc_root)
    assert written["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["default_runtime_name"] == "runc"
    assert "io.containerd.grpc.v1.cri" not in written["plugins"], "nvidia-ctk wrote the 1.x layout"

    dumped = _dump(config)  # what containerd 2 makes of it (migrated to its newest layout)
    runtime = dumped["plugins"]["io.containerd.cri.v1.runtime"]
    assert runtime["enable_cdi"] is True and runtime["cdi_spec_dirs"] == ["/etc/cdi", "/var/run/cdi"]
    assert runtime["containerd"]["runtimes"]["nvidia"]["runtime_type"] == "io.containerd.runc.v2"
    assert runtime["restrict_oom_score_adj"] is True
    assert dumped["plugins"]["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"] == (
        "registry.k8s.io/pause:3.10"
    )

    before = hashlib.sha256(config.read_bytes()).hexdigest()
    again = _configure(config)
    assert again.returncode == 0, again.stderr[-3000:]
    assert hashlib.sha256(config.read_bytes()).hexdigest() == before, "a second run changed the file"
