"""A claim's share on a card its node shares through MPS (``vgpu dra-plugin --sharing-mode mps``,
docs/dra.md#mps-shares): what Prepare checks beyond a time-sliced share.

What it writes is the device plugin's (:func:`vgpu.node.grants.limits` with ``mps``): the grant
says ``sharing = SHARING_MPS`` and names the pipe folder as the container sees it
(:data:`~vgpu.hookabi.layout.MPS_PIPE_IN_CONTAINER`, where the CDI spec mounts the card's
:meth:`~vgpu.node.paths.HostPaths.mps_pipe` read-only); the hook makes every process of the
container a client of the card's MPS daemon with the grant's cores as its active thread percentage
and its memory as its pinned memory limit.
"""

from __future__ import annotations

from vgpu.core.claimconfig import DRIVER, MPS_CLASS, VgpuConfig
from vgpu.dra.claims import ClaimError, ClaimPlan, Share
from vgpu.node.mps import accepts
from vgpu.node.paths import HostPaths


def check_sharing(
    claim_plan: ClaimPlan,
    request: str,
    shares: list[Share],
    config: VgpuConfig,
    sharing: str,
    paths: HostPaths,
) -> None:
    """``ClaimError`` where the request cannot be prepared on cards of mode ``sharing``: its
    configuration asks for the other mode, an MPS request holds more than one card (a process
    talks to one card's MPS daemon), or the card's MPS pipe folder is missing (no daemon)."""
    where = f"ResourceClaim {claim_plan.namespace}/{claim_plan.name}"
    if config.sharing is not None and config.sharing != sharing:
        raise ClaimError(
            where,
            "spec.devices.config[].opaque.parameters.sharing",
            f"request {request} is configured sharing: {config.sharing}, but it was allocated on a card "
            f"this node shares as {sharing}: ask for the DeviceClass "
            f"{MPS_CLASS if config.sharing == 'mps' else DRIVER}, or drop sharing",
        )
    if sharing != "mps":
        return
    if len(shares) > 1:
        raise ClaimError(
            where,
            f"spec.devices.requests[{request}].exactly.count",
            f"request {request} holds {len(shares)} cards shared through MPS; a process talks to one "
            "card's MPS daemon: ask for count 1 (one request per card)",
        )
    pipe = paths.mps_pipe(shares[0].uuid)
    if not accepts(pipe):
        raise ClaimError(
            where,
            "",
            f"card {shares[0].uuid}'s MPS control daemon does not answer at {pipe}: it is not "
            "running (the DRA plugin starts it and restarts it every 2 s); see the DRA plugin's log "
            "(docs/mps.md#failures-and-fixes)",
        )
