"""The product's own parts in the sandbox: filled in as they land."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vgpu.sandbox.cluster import Sandbox, Spec


def start(sandbox: Sandbox, spec: Spec, progress: Callable[[str], None]) -> None:
    return None
