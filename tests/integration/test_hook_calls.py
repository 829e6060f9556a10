"""The hook's files call each other one way only: native/hook/calls.py lists calls, fails on a cycle."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from types import ModuleType

from hook_harness import HOOK_DIR


def calls_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hook_calls", HOOK_DIR / "calls.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_two_files_of_the_hook_call_each_other() -> None:
    result = subprocess.run(
        [sys.executable, str(HOOK_DIR / "calls.py")], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # the region reads the grant; the grant calls nothing of the region's
    assert any(line.startswith("region.c -> grant.c: ") and "vgpu_grant_state" in line for line in lines)
    assert not any(line.startswith("grant.c -> region.c") for line in lines)
    assert any(line.startswith("memory.c -> region.c: ") for line in lines)


def test_a_circle_is_found_however_long() -> None:
    calls = calls_module()
    assert calls.cycle({"a.c": ["b.c"], "b.c": ["c.c"], "c.c": []}) is None
    assert calls.cycle({"a.c": ["b.c"], "b.c": ["a.c"]}) == ["a.c", "b.c", "a.c"]
    assert calls.cycle({"a.c": ["b.c"], "b.c": ["c.c"], "c.c": ["a.c"]}) == ["a.c", "b.c", "c.c", "a.c"]


def test_only_hidden_functions_of_hook_h_make_an_edge() -> None:
    calls = calls_module()
    header = (HOOK_DIR / "hook.h").read_text()
    functions = calls.hidden_functions(header)
    assert {"vgpu_charge", "vgpu_grant_state", "vgpu_log", "vgpu_cuda_ready"} <= functions
    assert not any(name.startswith(("real_", "__")) for name in functions)
    assert "vgpu_log_level" not in functions  # data, not a call
    graph = calls.edges(
        {"a.c": {"vgpu_charge"}, "b.c": {"vgpu_log", "cuMemAlloc_v2"}},
        {"a.c": {"vgpu_log", "memcpy"}, "b.c": {"vgpu_charge", "cuMemAlloc_v2"}},
        functions,
    )
    assert graph == {"a.c": {"b.c": ["vgpu_log"]}, "b.c": {"a.c": ["vgpu_charge"]}}
    assert calls.cycle(graph) == ["a.c", "b.c", "a.c"]
