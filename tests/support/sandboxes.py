"""A sandbox that runs the real node, for a test module's fixture."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from vgpu_sandbox.cluster import Sandbox
from vgpu_sandbox.realnode import prechecks

from tests.support.tmp import short_dir


@contextmanager
def real_node_sandbox(prefix: str) -> Iterator[Sandbox]:
    """A sandbox in a fresh ``/tmp/<prefix>...`` folder, brought down and removed at the end; the
    test skips, naming why, where this machine cannot run a real node (a failure under CI:
    tests/support/skips.py). The caller starts it (``sandbox.up(Spec(..., real_node=True))``)."""
    reason = prechecks.why_not()
    if reason:
        pytest.skip(f"no real node on this machine: {reason}")
    with short_dir(prefix) as state_dir:
        sandbox = Sandbox(state_dir)
        try:
            yield sandbox
        finally:
            sandbox.down()
