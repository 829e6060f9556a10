"""What ``vgpu status`` shows, as data: a node, its cards, and each share on a card."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Share:
    namespace: str
    pod: str
    container: str
    memory_mib: int
    cores: int  # percent of the card's compute; 0: no cap (the container may use the whole card)
    phase: str
    reason: str = ""
    env: dict[str, str] = field(default_factory=dict)
    # device memory the container's processes hold on this card, from its region as the node's
    # Lease last reported it; None when the node reported nothing for it
    used_bytes: int | None = None
    claim: str = ""  # DRA: the claim and request (<claim>/<request>) in place of a container
    init: bool = False  # an init container: runs before the app containers, which reuse its room
    finished: bool = False  # the pod finished (Succeeded or Failed): it holds nothing any more
    card: str = ""  # the card's UUID, where no card line above names it (the node lacks the card, or is gone)
    lines: list[str] | None = None  # what holds its device memory, as the Lease says (status_lines)
    codec: dict[str, int] | None = None  # its media engines' use on the card, percent
    mig: str = ""  # MIG on demand: the instance the share is ("3g.40gb at slice 4", docs/mig.md)


@dataclass
class CardStatus:
    index: int
    uuid: str
    model: str
    memory_mib: int
    cores: int
    split: int
    healthy: bool
    shares: list[Share] = field(default_factory=list)
    # what the card's pods hold as the scheduler counts it (vgpu.core.booking: a pod's footprint,
    # finished pods nothing); on a DRA node, the claims' shares together
    memory_used_mib: int = 0
    cores_used: int = 0
    vgpus_used: int = 0
    mode: str = ""  # hami-core, mps or mig (vgpu.core.selection.card_kind); "" where not known


@dataclass
class NodeStatus:
    name: str
    lease: str  # "fresh", "expired" or "missing"; "" on a DRA node (no device plugin, no Lease)
    error: str = ""
    mode: str = "device-plugin"  # or "dra": cards from the node's ResourceSlice
    cards: list[CardStatus] = field(default_factory=list)
    unplaced: list[Share] = field(default_factory=list)  # shares on cards the inventory lacks
    gone: bool = False  # no such Node: its pods are still bound to it, and hold nothing
