"""A claim's share on a card its node shares through MPS (``vgpu dra-plugin --sharing-mode mps``,
docs/dra.md#mps-shares): what Prepare checks and writes beyond a time-sliced share.

The grant says ``sharing = SHARING_MPS`` and names the pipe folder as the container sees it
(:data:`~vgpu.hookabi.layout.MPS_PIPE_IN_CONTAINER`, where the CDI spec mounts the card's
:meth:`~vgpu.plugin.paths.HostPaths.mps_pipe` read-only); the hook makes every process of the
container a client of the card's MPS daemon with the grant's cores as its active thread percentage
and its memory as its pinned memory limit. The three ``CUDA_MPS_*`` variables are set too, as a
convenience only: the hook sets them from the grant whatever the environment says.
"""

from __future__ import annotations

import dataclasses

from vgpu.core.claimconfig import VgpuConfig
from vgpu.dra.claims import ClaimError, ClaimPlan, Share
from vgpu.hookabi.grant import Grant
from vgpu.hookabi.layout import MPS_PIPE_IN_CONTAINER, SHARING_MPS
from vgpu.plugin.mps import accepts
from vgpu.plugin.paths import HostPaths


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
            f"{'mps.vgpu.openaios.io' if config.sharing == 'mps' else 'vgpu.openaios.io'}, or drop sharing",
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


def mps_limits(env: dict[str, str], grant: Grant, share: Share) -> tuple[dict[str, str], Grant]:
    """``env`` and ``grant`` (of one card's share) made an MPS client's."""
    out = dict(env)
    out["CUDA_MPS_PIPE_DIRECTORY"] = MPS_PIPE_IN_CONTAINER
    cores = min(share.cores, 100)
    if cores > 0:
        out["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(cores)
    out["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={share.memory_mib}M"
    return out, dataclasses.replace(grant, sharing=SHARING_MPS, mps_pipe=MPS_PIPE_IN_CONTAINER)
