"""Node policy: turn each candidate node's utilisation after placement into a score for kube-scheduler.

``binpack`` prefers the fullest node (fewer nodes carry vGPUs), ``spread`` the emptiest. Scores are
normalised over the candidate nodes of one request to 0..``MAX_SCORE`` (kube-scheduler's
``MaxExtenderPriority``), so even small differences separate the best node from the rest.
"""

from __future__ import annotations

from collections.abc import Mapping

from vgpu.core.config import BINPACK

MAX_SCORE = 10


def node_scores(utilization: Mapping[str, float], policy: str = BINPACK) -> dict[str, int]:
    """node -> score; ``utilization`` is each node's (0..1) as it would be with the pod on it."""
    if not utilization:
        return {}
    lo, hi = min(utilization.values()), max(utilization.values())
    if hi - lo < 1e-12:
        return dict.fromkeys(utilization, MAX_SCORE)
    out = {}
    for node, u in utilization.items():
        x = (u - lo) / (hi - lo)
        if policy != BINPACK:
            x = 1.0 - x
        out[node] = round(x * MAX_SCORE)
    return out
