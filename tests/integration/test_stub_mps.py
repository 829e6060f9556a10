"""The stub driver (CI's libcuda) behaves as the real one does under MPS: a process whose pipe
folder's control socket takes a connection at cuInit is an MPS client, records so for the fake
NVML, and is held to its pinned device memory limit; with no socket listening it runs outside MPS.
No hook here: this is the driver's side, which the hook's tests (test_hook_mps.py) build on."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hook_harness import Built, MpsPipe, build, env, process_file, run

MIB = 1 << 20
OUT_OF_MEMORY = 2


@pytest.fixture(scope="module")
def built() -> Built:
    return build()


@pytest.fixture
def pipe() -> Iterator[Path]:
    with MpsPipe() as p:
        yield p.path


def test_a_process_of_a_listening_pipe_is_an_mps_client_held_to_its_pinned_limit(
    built: Built, pipe: Path, tmp_path: Path
) -> None:
    environ = env(
        built,
        hook=False,
        STUB_CUDA_PROCESS_DIR=str(tmp_path),
        CUDA_MPS_PIPE_DIRECTORY=str(pipe),
        CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="40",
        CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=512M,1=2G",
    )
    r = run(built, "t_alloc", "procaddr", "alloc", "128", environ=environ)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (r.int("chunks"), r.int("refused"), r.int("again")) == (4, OUT_OF_MEMORY, 0)
    assert process_file(tmp_path) == {"0": 0, "mps": 1, "mps_threads": 40, "mps_pinned": 512 * MIB}


def test_an_mps_client_with_no_variables_gets_all_threads_and_no_pinned_limit(
    built: Built, pipe: Path, tmp_path: Path
) -> None:
    environ = env(built, hook=False, STUB_CUDA_PROCESS_DIR=str(tmp_path), CUDA_MPS_PIPE_DIRECTORY=str(pipe))
    r = run(built, "t_alloc", "procaddr", "alloc", "1024", environ=environ)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.int("chunks") == 8  # the whole fake device
    assert process_file(tmp_path) == {"0": 0, "mps": 1, "mps_threads": 100, "mps_pinned": 0}


def test_with_no_daemon_listening_the_process_runs_outside_mps_and_ignores_the_variables(
    built: Built, tmp_path: Path
) -> None:
    with tempfile.TemporaryDirectory(prefix="mps", dir="/tmp") as gone:
        environ = env(
            built,
            hook=False,
            STUB_CUDA_PROCESS_DIR=str(tmp_path),
            CUDA_MPS_PIPE_DIRECTORY=gone,
            CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=512M",
        )
        r = run(built, "t_alloc", "procaddr", "alloc", "1024", environ=environ)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.int("chunks") == 8
    assert process_file(tmp_path) == {"0": 0}
