"""Which cards a pod accepts: its selection annotations and the kinds of card it takes.

A card is of one kind (:func:`card_kind`): ``mig`` when it is cut into MIG instances on demand
(``Device.mig_dynamic``), ``mps`` when its containers are clients of its MPS daemon
(``Device.sharing == "mps"``, docs/mps.md), else ``hami-core`` (time-sliced under the hook). A pod
names the kinds it takes with HAMi's ``nvidia.com/vgpu-mode`` (a comma list takes the union); with
no annotation it takes ``hami-core`` and ``mig`` cards, never ``mps`` ones: the MPS clients of one
card share a fault domain, so only a pod that asks for that is put there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from vgpu.core import annotations as ann
from vgpu.core.errors import RequestError
from vgpu.core.quantity import SOURCE, shown

KIND_HAMI_CORE = "hami-core"
KIND_MIG = "mig"
KIND_MPS = "mps"
KINDS = (KIND_HAMI_CORE, KIND_MIG, KIND_MPS)
DEFAULT_KINDS = frozenset((KIND_HAMI_CORE, KIND_MIG))  # no nvidia.com/vgpu-mode: never an MPS card

# what each kind of card is, as a reason shows it
_KIND_TEXT = {
    KIND_HAMI_CORE: "time-sliced under the hook (hami-core)",
    KIND_MIG: "cut into MIG instances on demand (mig)",
    KIND_MPS: "shared through MPS (mps)",
}


def card_kind(card: ann.Device) -> str:
    """The card's kind: ``mig``, ``mps`` or ``hami-core`` (the module doc)."""
    if card.mig_dynamic is not None:
        return KIND_MIG
    if card.sharing == ann.SHARING_MPS:
        return KIND_MPS
    return KIND_HAMI_CORE


@dataclass(frozen=True)
class Selection:
    """Which cards a pod accepts (annotations ``nvidia.com/use-gputype`` and friends)."""

    use_types: tuple[str, ...] = ()
    nouse_types: tuple[str, ...] = ()
    use_uuids: tuple[str, ...] = ()
    nouse_uuids: tuple[str, ...] = ()
    # HAMi's nvidia.com/vgpu-mode: the kinds of card the pod takes (card_kind)
    kinds: frozenset[str] = DEFAULT_KINDS

    @property
    def selective(self) -> bool:
        """Whether the pod rules out any card but MPS ones (which only a pod asking ``mps`` takes:
        :meth:`rules_out` asks this first, so the fast paths pass over the rest cheaply)."""
        return bool(
            self.use_types
            or self.nouse_types
            or self.use_uuids
            or self.nouse_uuids
            or self.kinds != DEFAULT_KINDS
        )

    def rules_out(self, card: ann.Device, count: int = 1) -> bool:
        """Whether the pod does not accept ``card`` for a container of ``count`` vGPUs (cheap where
        the pod selects nothing)."""
        if not self.selective and card.sharing != ann.SHARING_MPS:
            return False
        return self.why_not_card(card, count) is not None

    def why_not_card(self, card: ann.Device, count: int = 1) -> str | None:
        """:meth:`why_not` for ``card``, for a container of ``count`` vGPUs: an MPS card takes
        only a container of one (its process talks to one card's MPS daemon)."""
        kind = card_kind(card)
        why = self.why_not(card.uuid, card.model, kind)
        if why is None and kind == KIND_MPS and count > 1:
            return f"{_KIND_TEXT[kind]}, which gives a container one card, not {count}"
        return why

    def why_not(self, uuid: str, model: str, kind: str = KIND_HAMI_CORE) -> str | None:
        """None when the card is acceptable, else a short reason naming the annotation.

        The reason does not name the card's UUID, so that cards ruled out alike count together
        (the fit lists the node's UUIDs once).
        """
        upper = model.upper()
        if self.use_types and not any(t.upper() in upper for t in self.use_types):
            return f"of model {model!r}, not in {self._listed[0]}"
        if any(t.upper() in upper for t in self.nouse_types):
            return f"of model {model!r}, excluded by {self._listed[1]}"
        if self.use_uuids and uuid not in self.use_uuids:
            return f"not in {self._listed[2]}"
        if uuid in self.nouse_uuids:
            return f"excluded by {ann.NOUSE_GPUUUID_ANNOTATION}"
        if kind not in self.kinds:
            return self.wrong_kind(kind)
        return None

    def wrong_kind(self, kind: str) -> str:
        """The reason a card of ``kind`` is not taken, naming the annotation and the card's mode."""
        if self.kinds == DEFAULT_KINDS:
            return (
                f"{_KIND_TEXT[kind]}, taken only by a pod whose {ann.HAMI_VGPU_MODE_ANNOTATION} names {kind}"
            )
        return f"{_KIND_TEXT[kind]}, not one {ann.HAMI_VGPU_MODE_ANNOTATION} {self._listed[3]} takes"

    @cached_property
    def _listed(self) -> tuple[str, str, str, str]:
        """Each annotation with its value, as the reasons name it (worked out once per pod)."""
        return (
            f"{ann.USE_GPUTYPE_ANNOTATION} {shown(','.join(self.use_types))}",
            f"{ann.NOUSE_GPUTYPE_ANNOTATION} {shown(','.join(self.nouse_types))}",
            f"{ann.USE_GPUUUID_ANNOTATION} {shown(','.join(self.use_uuids))}",
            ",".join(k for k in KINDS if k in self.kinds),
        )


def field_of(key: str) -> str:
    return f"metadata.annotations[{key}]"


def hami_modes(annos: Mapping[str, Any]) -> frozenset[str]:
    """HAMi's ``nvidia.com/vgpu-mode`` and ``nvidia.com/numa-bind``: accepted where they ask
    for what cards here give, refused where they ask for what none does. Returns the kinds of
    card the mode takes (``Selection.kinds``); :data:`DEFAULT_KINDS` for no annotation."""
    mode = annos.get(ann.HAMI_VGPU_MODE_ANNOTATION)
    # HAMi takes a card whose mode is named in the value ("hami-core,mig" takes either)
    names = {m.strip() for m in mode.split(",")} if isinstance(mode, str) else set()
    if mode is not None and not names & set(KINDS):
        raise RequestError(
            SOURCE,
            field_of(ann.HAMI_VGPU_MODE_ANNOTATION),
            f"must name hami-core, mig or mps (a comma list takes any of them), got {shown(mode)}: "
            "hami-core takes a card shared under the hook, mig a card cut into MIG instances on demand "
            "(migStrategy: dynamic, docs/mig.md), mps a card shared through MPS (sharingMode: mps, "
            "docs/mps.md)",
        )
    bind = annos.get(ann.HAMI_NUMA_BIND_ANNOTATION)
    # strconv.ParseBool's true spellings, as HAMi reads it; anything else means no binding there
    if isinstance(bind, str) and bind.strip() in ("1", "t", "T", "TRUE", "true", "True"):
        raise RequestError(
            SOURCE,
            field_of(ann.HAMI_NUMA_BIND_ANNOTATION),
            "true is not offered: a container of several vGPUs is placed on cards of one NUMA node "
            "where the node has such a set free (after NVLink-joined cards), never held back for one; "
            "remove the annotation",
        )
    if not names:
        return DEFAULT_KINDS
    return frozenset(names & set(KINDS))
