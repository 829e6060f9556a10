"""The grant on a real GPU: PyTorch, CuPy and JAX held to the limit the device plugin granted,
whatever the process's environment or its region file say.

Run on the GPU machine with `python3 -m pytest -m gpu tests/gpu/test_grant_gpu.py`. With
VGPU_GPU_REPORT set, the figures are appended to gpu_figures.jsonl there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from gpu_figures import record

from vgpu.hookabi.grant import Grant, write_grant
from vgpu.hookabi.region import Region

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "native" / "hook"
CHUNK_MIB = 256
LIMIT_MIB = 4096
MOST_CHUNKS = 64  # 16 GiB: the control without a grant never asks for more than that

# Allocates CHUNK_MIB chunks until the framework says out of memory (or MOST_CHUNKS), then
# prints how many it got. With "pause", it stops after the first chunk until a line on stdin.
CHILD = r"""
import sys
kind, chunk, most = sys.argv[1], int(sys.argv[2]) << 20, int(sys.argv[3])
pause = len(sys.argv) > 4
held = []
if kind == "torch":
    import torch
    take = lambda: torch.empty(chunk, dtype=torch.uint8, device="cuda")
    oom = torch.OutOfMemoryError
elif kind == "cupy":
    import cupy
    take = lambda: cupy.empty(chunk, dtype=cupy.uint8)
    oom = cupy.cuda.memory.OutOfMemoryError
else:
    import jax, jax.numpy as jnp
    take = lambda: jax.block_until_ready(jnp.zeros(chunk, dtype=jnp.uint8))
    oom = Exception  # XlaRuntimeError RESOURCE_EXHAUSTED; checked by the message below
while len(held) < most:
    try:
        held.append(take())
    except oom as err:
        if kind == "jax" and "RESOURCE_EXHAUSTED" not in str(err) and "out of memory" not in str(err).lower():
            raise
        break
    if pause and len(held) == 1:
        print("first", flush=True)
        sys.stdin.readline()
print(f"chunks={len(held)}", flush=True)
"""


@pytest.fixture(scope="module")
def lib() -> Path:
    subprocess.run(["make", "-s", "-C", str(HOOK)], check=True, capture_output=True, timeout=300)
    return HOOK / "build" / "libvgpu.so"


def base_env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("CUDA_DEVICE_", "CUDA_SM_", "LD_PRELOAD"))
    }
    return env | {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "VGPU_LOG_LEVEL": "warn"}


def make_grant(top: Path, limit_mib: int = LIMIT_MIB) -> tuple[Path, Path]:
    folder = top / "containers" / "uid-1_main"
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    region = folder / "vgpu.region"
    grant = top / "grants" / "uid-1_main.limits"
    uuid = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader", "-i", "0"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    write_grant(grant, Grant((uuid,), (limit_mib << 20,), region_path=str(region)))
    return grant, region


def chunks(out: str) -> int:
    return int(next(line for line in out.splitlines() if line.startswith("chunks=")).split("=")[1])


@pytest.mark.parametrize("kind", ["torch", "cupy", "jax"])
def test_each_framework_is_held_to_the_grant_over_a_lying_environment(
    lib: Path, kind: str, tmp_path: Path
) -> None:
    grant, _ = make_grant(tmp_path)
    lying = base_env() | {
        "LD_PRELOAD": str(lib),
        "CUDA_DEVICE_MEMORY_LIMIT": "64g",
        "VGPU_CONTEXT_RESERVE": "0",
    }
    argv = [sys.executable, "-c", CHILD, kind, str(CHUNK_MIB), str(MOST_CHUNKS)]
    control = subprocess.run(argv, env=lying, capture_output=True, text=True, timeout=300, check=False)
    held = subprocess.run(
        argv,
        env=lying | {"VGPU_GRANT_FILE": str(grant)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert control.returncode == 0 and held.returncode == 0, control.stderr[-2000:] + held.stderr[-2000:]
    record(
        "grant_env_lies",
        framework=kind,
        control_chunks=chunks(control.stdout),
        held_chunks=chunks(held.stdout),
    )
    assert chunks(control.stdout) > LIMIT_MIB // CHUNK_MIB  # the environment alone would have let it through
    assert 0 < chunks(held.stdout) * CHUNK_MIB <= LIMIT_MIB - 640  # the grant's context charge counts too
    assert "the grant holds" in held.stderr


def test_a_limit_raised_in_the_region_while_torch_runs_is_put_back(lib: Path, tmp_path: Path) -> None:
    grant, region = make_grant(tmp_path)
    env = base_env() | {"LD_PRELOAD": str(lib), "VGPU_GRANT_FILE": str(grant)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, "torch", str(CHUNK_MIB), str(MOST_CHUNKS), "pause"],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline().strip() == "first"
    with Region(region, writable=True) as r:
        r.set_limit(0, 100 << 30)
    out, err = child.communicate("go\n", timeout=300)
    assert child.returncode == 0, err[-2000:]
    record("grant_region_raised", chunks=chunks(out))
    assert chunks(out) * CHUNK_MIB <= LIMIT_MIB - 640
    assert "its limits were changed on disk" in err
    with Region(region) as r:
        assert r.word("limit", 0) == LIMIT_MIB << 20


NAMESPACE = r"""
set -eu
mkdir -p "$T/up" "$T/work"
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$T/up,workdir=$T/work" /etc
echo "$LIB" > /etc/ld.so.preload
mkdir -p /etc/vgpu && : > /etc/vgpu/limits
mount --bind "$GRANT" /etc/vgpu/limits && mount -o remount,bind,ro /etc/vgpu/limits
if [ "$AS" = nobody ]; then run="setpriv --reuid 65534 --regid 65534 --clear-groups"; else run=""; fi
try='printf x >> /etc/vgpu/limits 2>/dev/null'
$run sh -c "if $try; then echo grant_writable=1; else echo grant_writable=0; fi"
exec $run env -u LD_PRELOAD CUDA_DEVICE_MEMORY_LIMIT=64g VGPU_CONTEXT_RESERVE=0 "$PY" -c "$CHILD" torch 256 64
"""


def test_in_a_containers_position_torch_is_held_with_ld_preload_unset(lib: Path) -> None:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare (util-linux) to make a mount namespace")
    top = Path(tempfile.mkdtemp(prefix="vgpu-ctr-"))
    try:
        top.chmod(0o755)
        shutil.copy2(lib, top / "libvgpu.so")
        grant, _ = make_grant(top)
        (top / "containers").chmod(0o755)
        results = {}
        for who in ("nobody", "root"):
            proc = subprocess.run(
                ["unshare", "-m", "--propagation", "private", "sh", "-c", NAMESPACE],
                env=base_env() | {"T": str(top / who), "LIB": str(top / "libvgpu.so"), "GRANT": str(grant),
                                  "AS": who, "PY": sys.executable, "CHILD": CHILD},
                capture_output=True, text=True, timeout=300, check=False,
            )  # fmt: skip
            results[who] = proc
            if proc.returncode == 0:
                break
        who, proc = list(results.items())[-1]
        if proc.returncode != 0 and "overlay" in proc.stderr:
            pytest.skip(
                f"this machine refuses a mount namespace with an overlay on /etc: {proc.stderr[-500:]}"
            )
        assert proc.returncode == 0, {w: (p.stdout, p.stderr[-2000:]) for w, p in results.items()}
        record("grant_container_position", user=who, chunks=chunks(proc.stdout))
        assert "grant_writable=0" in proc.stdout  # a read-only mount: root in the container cannot either
        assert 0 < chunks(proc.stdout) * CHUNK_MIB <= LIMIT_MIB - 640
        assert "the grant holds" in proc.stderr
    finally:
        shutil.rmtree(top, ignore_errors=True)
