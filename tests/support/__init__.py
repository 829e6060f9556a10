"""What the tests share: waiting for a condition, a short temp folder, pods, a fake API server,
child processes. ``from tests.support import wait_for, pod, FakeKube, ...``.

Nothing here imports ``fuzz``: the fuzz harnesses import only ``vgpu``, and the tests import them.
"""

from tests.support.kube import FakeKube
from tests.support.pods import bound_pod, container, pod
from tests.support.procs import VGPU, running, start, stop, vgpu
from tests.support.tmp import short_dir
from tests.support.wait import poll, wait_for

__all__ = [
    "VGPU",
    "FakeKube",
    "bound_pod",
    "container",
    "pod",
    "poll",
    "running",
    "short_dir",
    "start",
    "stop",
    "vgpu",
    "wait_for",
]
