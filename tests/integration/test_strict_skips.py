"""A skip where every test must run fails the run, naming why (tests/support/skips.py): a real
pytest over a small module of skipping tests, with the switches as .ci/run and make gpu-test set
them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.skips import ALLOWED, allowed, short_name, verdict

ROOT = Path(__file__).resolve().parents[2]

MODULE = """
import pytest

def test_real_node():
    pytest.skip("no real node on this machine: another kubelet serves its socket")

@pytest.mark.gpu
def test_on_gpu():
    pytest.skip("PyTorch is not installed in this Python")

def test_runs():
    pass
"""


def _pytest(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_skipping.py").write_text(MODULE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n  gpu: needs a GPU\n")
    clean = {k: v for k, v in os.environ.items() if k not in ("VGPU_STRICT_SKIPS", "VGPU_GPU_REQUIRED")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "tests.support.skips", "test_skipping.py"],
        cwd=tmp_path,
        env=clean | {"PYTHONPATH": str(ROOT)} | env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_under_ci_a_skip_fails_naming_its_reason_and_the_list_is_printed(tmp_path: Path) -> None:
    run = _pytest(tmp_path, VGPU_STRICT_SKIPS="1")
    assert run.returncode == 1, run.stdout
    assert "FAILED test_skipping.py::test_real_node" in run.stdout
    assert "SKIPPED where every test must run: no real node on this machine: another kubelet" in run.stdout
    assert "2 failed, 1 passed" in run.stdout
    # the allowed skips, each with why, are printed
    assert "skips allowed where every test must run" in run.stdout
    for entry in ALLOWED:
        assert entry.test in run.stdout and entry.why in run.stdout


def test_without_the_switch_the_same_tests_skip_saying_why_but_a_gpu_test_still_fails(tmp_path: Path) -> None:
    run = _pytest(tmp_path)
    assert "SKIPPED [1] test_skipping.py:5: no real node on this machine" in run.stdout, run.stdout
    # a GPU test that cannot run fails unless VGPU_GPU_REQUIRED=0
    assert "FAILED test_skipping.py::test_on_gpu - SKIPPED where every test must run" in run.stdout
    assert run.returncode == 1
    relaxed = _pytest(tmp_path, VGPU_GPU_REQUIRED="0")
    assert relaxed.returncode == 0, relaxed.stdout
    assert "1 passed, 2 skipped" in relaxed.stdout
    assert "PyTorch is not installed in this Python" in relaxed.stdout


def test_an_allowed_test_may_skip_only_for_its_own_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VGPU_STRICT_SKIPS", "1")
    entry = ALLOWED[0]
    nodeid = f"{entry.test}[x]@tests/integration"
    assert short_name(nodeid) == entry.test
    assert allowed(nodeid, f"because {entry.reason}") == entry
    assert verdict(nodeid, f"because {entry.reason}", is_gpu=False) is None
    other = verdict(nodeid, "the hook is not built", is_gpu=False)
    assert other is not None and "the hook is not built" in other


def test_every_allowed_entry_names_a_test_that_exists() -> None:
    for entry in ALLOWED:
        path, _, function = entry.test.partition("::")
        assert f"def {function}(" in (ROOT / path).read_text(), entry
