"""``vgpu status``'s view of what holds each container's device memory and its media engines'
use, from the node's Lease (contract 2: ``vgpu.openaios.io/memory-lines`` and
``vgpu.openaios.io/codec``, written by the node monitor, ``vgpu.monitor.lines``).

A share's line then ends with, for instance, ``held by hook+driver-cap+node  dec 12% jpg 30%``;
``held by none`` where no line holds it (the hook not in it, no driver cap, the enforcer only
reporting). A Lease without the annotations (an older plugin) or with malformed ones shows
nothing more: status never fails on them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from vgpu.core.annotations import CODEC_ANNOTATION, LINES_ANNOTATION

ENGINES = ("dec", "enc", "jpg", "ofa")


def _load(lease: dict[str, Any] | None, key: str) -> dict[str, Any]:
    text = ((lease or {}).get("metadata", {}).get("annotations") or {}).get(key)
    try:
        loaded = json.loads(text) if text else {}
    except ValueError:
        return {}
    return loaded if isinstance(loaded, dict) else {}


@dataclass
class NodeExtras:
    lines: dict[str, Any] = field(default_factory=dict)  # container folder -> the lines holding it
    codec: dict[str, Any] = field(default_factory=dict)  # container folder -> card -> engine -> percent

    def of(self, folder: str, uuid: str) -> tuple[list[str] | None, dict[str, int] | None]:
        """The lines holding one container and its engines' use on one card (None: not reported)."""
        lines = self.lines.get(folder)
        held = [str(x) for x in lines] if isinstance(lines, list) else None
        cards = self.codec.get(folder)
        use = cards.get(uuid) if isinstance(cards, dict) else None
        if not isinstance(use, dict):
            return held, None
        return held, {k: int(v) for k, v in use.items() if k in ENGINES and isinstance(v, int)}


def node_extras(lease: dict[str, Any] | None) -> NodeExtras:
    return NodeExtras(_load(lease, LINES_ANNOTATION), _load(lease, CODEC_ANNOTATION))


def extras_text(lines: list[str] | None, codec: dict[str, int] | None) -> str:
    text = ""
    if lines is not None:
        text += f"  held by {'+'.join(lines) or 'none'}"
    if codec:
        text += "  " + " ".join(f"{k} {codec[k]}%" for k in ENGINES if k in codec)
    return text
