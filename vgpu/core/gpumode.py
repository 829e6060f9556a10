"""One mode per node: which path hands out a node's cards (docs/dra.md, "One mode per node").

A node's cards are booked either by the device-plugin path (the extender's ledger, the device
plugin's Allocate) or by DRA (the kube-scheduler's allocator over the node's ResourceSlices,
the DRA driver's NodePrepareResources), never by both: the two books know nothing of each
other, so a card in both would be promised twice. The node label ``openaios.io/gpu-mode`` says
which; absent, the node is a device-plugin node, as every node was before DRA.
"""

from __future__ import annotations

from collections.abc import Mapping

from vgpu.core.claimconfig import DRIVER

GPU_MODE_LABEL = "openaios.io/gpu-mode"
DEVICE_PLUGIN = "device-plugin"
DRA = "dra"
MODES = (DEVICE_PLUGIN, DRA)


def gpu_mode(labels: Mapping[str, str] | None) -> str:
    """The node's mode as its labels say: ``device-plugin`` when the label is absent or empty.

    Any other value is returned as it is; callers treat a value outside :data:`MODES` as "not
    this path" (see :func:`device_plugin_refusal`), so a mistyped label never books a card twice.
    """
    value = (labels or {}).get(GPU_MODE_LABEL)
    return value if value else DEVICE_PLUGIN


def device_plugin_refusal(labels: Mapping[str, str] | None) -> str | None:
    """Why the device-plugin path must not book this node's cards, or None when it may.

    A predicate, as the extender's other node reasons (kube-scheduler prefixes ``node(s)``);
    never a ``%`` (kube-scheduler's event recorder reads the message as a format).
    """
    mode = gpu_mode(labels)
    if mode == DEVICE_PLUGIN:
        return None
    if mode == DRA:
        return (
            f"had label {GPU_MODE_LABEL}={DRA} (DRA mode): DRA hands out the GPUs there, through "
            f"ResourceClaims of the DeviceClass {DRIVER}, not nvidia.com/gpu; give the pod a "
            f"claim (docs/dra.md), or label the node {GPU_MODE_LABEL}={DEVICE_PLUGIN}"
        )
    return (
        f"had label {GPU_MODE_LABEL}={mode!r}, neither {DEVICE_PLUGIN} nor {DRA}: "
        f"set it to one of the two (absent means {DEVICE_PLUGIN})"
    )
