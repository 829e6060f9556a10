"""Every input a fuzz harness ever failed on, replayed through the harness's own property.

``fuzz/regressions/<harness>/`` holds the inputs (docs/fuzzing.md says how one lands there); the
seed corpora ``fuzz/corpus/<harness>/`` are replayed too, so the replay always has inputs and the
seeds stay valid examples. Python harnesses run their ``fuzz.properties`` check here; the native
ones are built with gcc and ASan/UBSan around a small driver (``fuzz/native/replay.c``), so this
needs neither atheris nor clang.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from fuzz.properties import TARGETS
from vgpu.core import annotations as ann
from vgpu.core.errors import AnnotationError, RequestError
from vgpu.core.requests import parse_quantity

ROOT = Path(__file__).resolve().parents[2]
FUZZ = ROOT / "fuzz"
HOOK = ROOT / "native" / "hook"
NATIVE = {  # the harness, then the hook's files it links (as fuzz/native/Makefile does)
    "config_env": ["fuzz_config.c", "config.c", "log.c"],
    "region_hook": ["fuzz_region.c", "config.c", "log.c", "track.c", "slots.c"]
    + (["grant.c"] if (HOOK / "grant.c").exists() else []),  # region.c calls it where the hook has one
    # grant.c #included
    "grant_hook": ["fuzz_grant.c", "region.c", "region_file.c", "slots.c", "config.c", "log.c", "track.c"],
}


def _inputs(harnesses: Iterable[str]) -> list[Any]:
    cases = []
    for kind in ("regressions", "corpus"):
        for name in sorted(harnesses):
            for path in sorted((FUZZ / kind / name).glob("*")):
                cases.append(pytest.param(name, path, id=f"{kind}/{name}/{path.name}"))
    return cases


def test_every_input_folder_is_a_harness() -> None:
    """A misspelt folder would be replayed by nothing: each one must name a harness."""
    known = set(TARGETS) | set(NATIVE)
    for kind in ("regressions", "corpus"):
        folders = {p.name for p in (FUZZ / kind).iterdir() if p.is_dir()}
        assert folders <= known, f"fuzz/{kind}/ has folders no harness reads: {sorted(folders - known)}"
    assert {p.name for p in (FUZZ / "corpus").iterdir()} == known, "every harness needs seeds"


@pytest.mark.parametrize(("harness", "path"), _inputs(TARGETS))
def test_python_harness_input(harness: str, path: Path) -> None:
    TARGETS[harness](path.read_bytes())


@pytest.fixture(scope="module")
def replay_bin(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    gcc = shutil.which("gcc")
    assert gcc, "gcc is needed to build the native hook and its fuzz replays (make setup)"
    out = tmp_path_factory.mktemp("fuzz-replay")
    built = {}
    for name, sources in NATIVE.items():
        paths = [str(FUZZ / "native" / "replay.c"), str(FUZZ / "native" / sources[0])]
        paths += [str(HOOK / s) for s in sources[1:]]
        exe = out / name
        subprocess.run(
            [gcc, "-g", "-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
            + ["-Wall", "-Wextra", "-Werror", f"-I{HOOK}", "-o", str(exe), *paths, "-lpthread"],
            check=True,
        )
        built[name] = exe
    return built


@pytest.mark.parametrize(("harness", "path"), _inputs(NATIVE))
def test_native_harness_input(harness: str, path: Path, replay_bin: dict[str, Path]) -> None:
    run = subprocess.run([str(replay_bin[harness]), str(path)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, f"{harness} failed on {path.name}:\n{run.stderr[-3000:]}"
    assert f"replayed {path}" in run.stdout


# What the regressions were about, stated directly: the error a user sees names the field.


def test_a_quantity_past_int64_is_refused_quickly_naming_the_field() -> None:
    """A text such as 1e999999999 used to be computed exactly: minutes of CPU and gigabytes."""
    for text in ("1e999999999", "9223372036854775808", "1e100"):
        with pytest.raises(RequestError, match=r"limits\[nvidia.com/gpumem\]: is out of range"):
            parse_quantity(text, "spec.containers[0].resources.limits[nvidia.com/gpumem]")
    assert parse_quantity("9223372036854775807", "f") == 2**63 - 1
    assert parse_quantity("1e3", "f") == 1000
    with pytest.raises(RequestError, match="must be a whole number"):
        parse_quantity("1e-999999999", "f")


def test_a_deeply_nested_annotation_is_an_annotation_error() -> None:
    with pytest.raises(AnnotationError, match="nested too deeply"):
        ann.decode_devices("[" * 100_000)
