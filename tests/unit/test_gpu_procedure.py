"""Every GPU module runs in the documented procedure: each is in exactly one part of
tests/gpu/procedure.py, and each part names a bundle part that tools/gpu-bundle.sh makes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

GPU = Path(__file__).resolve().parents[1] / "gpu"


def _parts() -> dict[str, tuple[str, tuple[str, ...]]]:
    spec = importlib.util.spec_from_file_location("gpu_procedure", GPU / "procedure.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parts: dict[str, tuple[str, tuple[str, ...]]] = module.PARTS
    return parts


def test_every_gpu_module_is_in_exactly_one_part() -> None:
    listed = [m for _, modules in _parts().values() for m in modules]
    on_disk = sorted(p.name for p in GPU.glob("test_*.py"))
    assert sorted(listed) == on_disk, "tests/gpu/procedure.py must list each GPU module once"


def test_each_part_stages_a_bundle_part_that_exists() -> None:
    bundle = (GPU.parents[1] / "tools" / "gpu-bundle.sh").read_text()
    for bundle_part, _ in _parts().values():
        assert bundle_part in ("a", "b") and "stage a|b" in bundle
