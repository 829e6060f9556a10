"""What `make demo REAL_NODE=1` says of its pod's output is what the hook does.

The real node's pod prints ``chunks=9 refused=2 held=0``; issue 37: "held=0" and the 640 MiB
context charge behind "9" went unexplained. Here the same programs run under the hook and the
stub driver with the grant the device plugin writes (the demo's 3000 MiB, the hook's default
context charge), and the demo's explanation of their output must give their numbers.
"""

from __future__ import annotations

from pathlib import Path

from hook_harness import Holder, build, env, run
from vgpu_sandbox import demo

from vgpu.hookabi.grant import DEFAULT_CONTEXT_RESERVE, Grant, write_grant

MIB = 1 << 20


def test_the_demo_explains_each_value_of_its_pod_in_the_numbers_the_hook_gave(tmp_path: Path) -> None:
    built = build()
    region = tmp_path / "containers/uid-1_cuda/vgpu.region"
    region.parent.mkdir(parents=True)
    grant = tmp_path / "grants/uid-1_cuda.limits"
    # as Allocate writes it (vgpu/deviceplugin/answer.py): the context charge left at the hook's default
    write_grant(grant, Grant(("GPU-stub-0",), (demo.LIMIT_MIB * MIB,), (0,), region_path=str(region)))
    environ = env(built, VGPU_GRANT_FILE=str(grant))
    alloc = run(built, "t_alloc", "link", "alloc", str(demo.CHUNK_MIB), environ=environ)
    assert alloc.returncode == 0, alloc.stderr
    with Holder(built, demo.HOLD_MIB, environ) as holder:
        held = holder.held
    # the pod's log: its echo, t_alloc's two lines the pod keeps (grep), t_hold's line
    logs = "\n".join(
        [f"limit={demo.LIMIT_MIB}m preload=/usr/local/vgpu/libvgpu.so"]
        + [line for line in alloc.lines if line.startswith(("chunks=", "refused="))]
        + [held]
    )
    chunks, context = alloc.int("chunks"), DEFAULT_CONTEXT_RESERVE // MIB
    # what the hook did: the context's charge first, then as many chunks as fit beside it
    assert context + chunks * demo.CHUNK_MIB <= demo.LIMIT_MIB < context + (chunks + 1) * demo.CHUNK_MIB
    said = demo.explain(logs)
    assert [line.split(":")[0] for line in said] == ["limit=3000m", f"chunks={chunks}", "refused=2", "held=0"]
    text = "\n".join(said)
    assert f"{chunks} x 256 MiB = {chunks * 256} MiB; with the {context} MiB the hook charges" in text
    assert f"{context + chunks * 256} of the 3000 MiB" in text
    assert f"would have made {context + (chunks + 1) * 256} MiB" in text
    assert "CUDA_ERROR_OUT_OF_MEMORY (2, a CUDA result code, not MiB)" in text
    assert "cuMemAlloc of 1024 MiB returned CUDA_SUCCESS (0, a CUDA result code, not MiB)" in text
    assert f"the container using {1024 + context} MiB" in text
