"""A real container on the real GPU: containerd and runc start it with what the plugin's Allocate
(on real NVML) handed out, and the hook, loaded through the container's /etc/ld.so.preload,
holds the real driver to the grant.

Runs with `pytest -m gpu` on a GPU machine that has runc on PATH and containerd 2 built into
VGPU_BIN_DIR (`tools/build.sh containerd`, as the sandbox's real node has it). The container's
root file system holds the hook's test programs and the C library they need; the NVIDIA driver's
libraries and device nodes are put in, as the NVIDIA container runtime does. The kubelet's side
is the sandbox's stand-in (tests/e2e/test_real_node.py runs the upstream kubelet, on the stub
driver).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_plugin_on_gpu import bind_pod, plugin_on_real_nvml  # tests/gpu is on sys.path
from vgpu_sandbox import binaries
from vgpu_sandbox.realnode import configs, layout, lifecycle, prechecks

from vgpu.node.hooklib import install_hook
from vgpu.node.nvml import NvmlDiscovery
from vgpu.node.paths import HostPaths

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "native" / "hook" / "build"
PROGRAMS = ("t_alloc", "t_info")
DRIVER_LIBS = ("libcuda.so.1", "libnvidia-ml.so.1")


def _tool(name: str) -> str:
    if name in prechecks.CONTAINERD_BINARIES:
        built = binaries.bin_dir() / name
        if not built.exists():
            pytest.skip(f"{name} is not built in {built.parent}: run `tools/build.sh containerd`")
        return str(built)
    found = shutil.which(name)
    if not found:
        pytest.skip(
            f"{name} is not on PATH: this GPU machine has no container runtime to run a container with"
        )
    return found


def _ldd(path: Path) -> list[Path]:
    out = subprocess.run(["ldd", str(path)], capture_output=True, text=True, check=True).stdout
    return [Path(p) for p in re.findall(r"(/\S+) \(0x", out)]


def _driver_lib(name: str) -> Path:
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.strip().startswith(name + " ") and "x86-64" in line:
            return Path(line.rsplit("=> ", 1)[1].strip())
    for folder in ("/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/x86_64-linux-gnu"):
        if (Path(folder) / name).exists():
            return Path(folder) / name
    pytest.skip(f"the driver's {name} is not found")


def _rootfs(folder: Path) -> Path:
    """Programs, the libraries they need, and the driver's libraries, as the runtime injects them."""
    rootfs = folder / "rootfs"
    libdir = rootfs / "usr" / "lib" / "x86_64-linux-gnu"
    for sub in (
        "usr/local/bin",
        "usr/lib/x86_64-linux-gnu",
        "etc",
        "tmp",
        "proc",
        "dev",
        "lib64",
        "usr/local/vgpu",
    ):
        (rootfs / sub).mkdir(parents=True, exist_ok=True)
    needed: set[Path] = set()
    for name in PROGRAMS:
        shutil.copy2(BUILD / "tests" / name, rootfs / "usr" / "local" / "bin" / name)
        needed |= set(_ldd(BUILD / "tests" / name))
    needed |= set(_ldd(BUILD / "libvgpu.so"))
    for name in DRIVER_LIBS:
        lib = _driver_lib(name).resolve()
        shutil.copy2(lib, libdir / name)
        needed |= set(_ldd(lib))
    for lib in needed:
        if "stub" in str(lib) or lib.name in DRIVER_LIBS:
            continue
        target = rootfs / str(lib).lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib.resolve(), target)
        shutil.copy2(lib.resolve(), libdir / lib.name)
    (rootfs / "etc" / "ld.so.preload").write_text("")  # the mount goes over a file
    return rootfs


@pytest.fixture
def work() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="vgpu-ct-"))
    try:
        yield path
    finally:
        lifecycle.unmount_under(path)
        shutil.rmtree(path, ignore_errors=True)


def test_a_container_started_by_containerd_with_the_plugins_allocate_is_held_to_its_grant(work: Path) -> None:
    tools = {name: _tool(name) for name in ("containerd", "ctr", "runc")}
    if not (BUILD / "libvgpu.so").exists() or not all((BUILD / "tests" / p).exists() for p in PROGRAMS):
        pytest.skip("the hook is not built: make native")

    # The plugin on real NVML, with the hook installed as the DaemonSet installs it.
    node_root = work / "node"
    hook = install_hook(BUILD / "libvgpu.so", HostPaths(node_root))
    lay = layout.NodeLayout(work / "ctd")
    containerd: subprocess.Popen[bytes] | None = None
    with plugin_on_real_nvml(node_root, hook) as (api, kubelet, _daemon):
        try:
            card = NvmlDiscovery().cards()[0]
            bind_pod(api, "u1", card.uuid, 3000, 30)
            response = kubelet.allocate_container("u1", "nvidia.com/gpu", 1)
            assert response.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "3000m"
            mounts = {m.container_path: (m.host_path, m.read_only) for m in response.mounts}
            assert {"/etc/ld.so.preload", "/etc/vgpu/limits", "/usr/local/vgpu/libvgpu.so"} <= set(mounts)

            # containerd, with everything of its own under the work folder.
            lay.root.mkdir(parents=True)
            lay.containerd_config.write_text(
                configs.containerd_config(lay, "registry.k8s.io/pause:3.10", Path("/"))
            )
            containerd = subprocess.Popen(
                [tools["containerd"], f"--config={lay.containerd_config}"],
                stdout=open(work / "containerd.log", "wb"),  # noqa: SIM115 - closed with the process
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # ctr's containers find their shim on PATH: the one built with this containerd
                env={**os.environ, "PATH": f"{binaries.bin_dir()}:{os.environ.get('PATH', '')}"},
            )
            ctr = [tools["ctr"], f"--address={lay.containerd_socket}", "--namespace=vgpu-test"]
            deadline = time.monotonic() + 30
            while subprocess.run([*ctr, "version"], capture_output=True).returncode != 0:
                assert time.monotonic() < deadline, (work / "containerd.log").read_text()[-3000:]
                time.sleep(0.3)

            rootfs = _rootfs(work)
            devices = [
                d
                for d in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
                if os.path.exists(d)
            ]

            def run(name: str, argv: list[str], with_preload: bool = True) -> str:
                args = [*ctr, "run", "--rm", "--rootfs"]  # a flag: the folder comes after every flag
                for path, (host, read_only) in mounts.items():
                    if path == "/etc/ld.so.preload" and not with_preload:
                        continue
                    options = "rbind:ro" if read_only else "rbind:rw"
                    args.append(f"--mount=type=bind,src={host},dst={path},options={options}")
                args += [f"--device={d}" for d in devices]
                args += [f"--env={k}={v}" for k, v in response.envs.items()]
                done = subprocess.run(
                    # ctr's containers keep runc's state under /run/containerd: ids of their own
                    [*args, str(rootfs), f"vgpu-{name}-" + re.sub("[^A-Za-z0-9]", "", work.name), *argv],
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
                return done.stdout + done.stderr

            text = run("alloc", ["/usr/local/bin/t_alloc", "link", "alloc", "256"])
            fields = dict(re.findall(r"^(\w+)=(\S+)$", text, re.M))
            print(f"in a containerd container on {card.model}: {fields}")
            chunks, refused = int(fields["chunks"]), int(fields["refused"])
            assert refused == 2 and 1 <= chunks and chunks * 256 <= 3000, text
            # One bounded allocation past the grant: refused with the preload, granted without it.
            one = run("one", ["/usr/local/bin/t_info", "link", "4000"])
            held = dict(re.findall(r"^(\w+)=(\S+)$", one, re.M))
            bare_text = run("bare", ["/usr/local/bin/t_info", "link", "4000"], with_preload=False)
            bare = dict(re.findall(r"^(\w+)=(\S+)$", bare_text, re.M))
            print(
                f"4000 MiB at once: with the preload alloc={held.get('alloc')}, without {bare.get('alloc')}"
            )
            assert held.get("alloc") == "2" and bare.get("alloc") == "0", (held, bare)
            # What the container's processes see of the card: the grant, not the card (whose
            # total by CUDA is a little under NVML's: 81079 of 81559 MiB on an H100).
            card_bytes = card.memory_mib << 20
            assert int(held["cu_total"]) == 3000 << 20, (held, bare)
            assert card_bytes * 9 // 10 < int(bare["cu_total"]) <= card_bytes, (held, bare, card)
        finally:
            if containerd is not None:
                containerd.terminate()
                try:
                    containerd.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    containerd.kill()
