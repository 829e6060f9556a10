"""The lock files (make lock): every dependency of pyproject.toml pinned, the two locks agreeing, and
the versions the extender's hand-written parts check for at start being the lock's."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from vgpu.extender import fastpath

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    assert match, spec
    return canonical(match.group(1))


def pins(lock: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (REPO / lock).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        assert not line.startswith("-"), f"{lock}: an option in the lock ({line}) would reach every install"
        name, sep, version = line.partition("==")
        assert sep and version.strip(), f"{lock}: {line!r} is not pinned to one version"
        out[canonical(name)] = version.strip()
    return out


RUNTIME = [requirement_name(d) for d in PYPROJECT["project"]["dependencies"]]
DEV = [requirement_name(d) for d in PYPROJECT["project"]["optional-dependencies"]["dev"]]


@pytest.mark.parametrize(
    ("lock", "wanted"), [("requirements.lock", RUNTIME), ("requirements-dev.lock", RUNTIME + DEV)]
)
def test_the_lock_pins_every_dependency_of_pyproject(lock: str, wanted: list[str]) -> None:
    missing = sorted(set(wanted) - set(pins(lock)))
    assert not missing, f"{lock} lacks {missing}: run `make lock`"


def test_the_dev_lock_pins_the_products_dependencies_as_the_runtime_lock_does() -> None:
    runtime, dev = pins("requirements.lock"), pins("requirements-dev.lock")
    differ = {name: (v, dev.get(name)) for name, v in runtime.items() if dev.get(name) != v}
    assert not differ


def test_the_versions_checked_at_start_are_the_locks() -> None:
    runtime = pins("requirements.lock")
    assert {name: runtime[name] for name in fastpath.TESTED} == fastpath.TESTED
