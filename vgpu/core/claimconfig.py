"""The vgpu DRA driver's opaque configuration: what a claim or a DeviceClass sets beyond capacity.

Contract 8 (docs/contracts.md). A ResourceClaim (``spec.devices.config``), a template
(``spec.spec.devices.config``) or a DeviceClass (``spec.config``) may carry entries of the form

    requests: [gpu]                 # optional: the requests it applies to; none: all of them
    opaque:
      driver: vgpu.openaios.io
      parameters:
        apiVersion: vgpu.openaios.io/v1
        kind: VgpuConfig
        priority: 0                 # 0 high, 1 normal (the default), as nvidia.com/priority
        smPolicy: elastic           # cap or elastic; default: the node config's smPolicy

The scheduler copies the class's entries and then the claim's into
``status.allocation.devices.config`` (``source: FromClass`` / ``FromClaim``), in that order; a
later entry's field wins over an earlier one's, so a claim overrides its class. Entries of other
drivers are not ours to judge and are passed over.

Pure: the admission webhook checks a claim or template with :func:`check_entries` when it is
written, and the DRA plugin resolves each request's configuration with :func:`for_request` when
it prepares the claim (checking again: a claim written while the webhook was away).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vgpu.core.errors import FieldError

DRIVER = "vgpu.openaios.io"
API_VERSION = "vgpu.openaios.io/v1"
KIND = "VgpuConfig"
SM_POLICIES = ("cap", "elastic")
_FIELDS = ("apiVersion", "kind", "priority", "smPolicy")


class ConfigEntryError(FieldError):
    """An entry of this driver's opaque configuration that is malformed; ``field`` is its path."""


@dataclass(frozen=True)
class VgpuConfig:
    """What a request of a claim is configured with; None: not set (the default applies)."""

    priority: int | None = None
    sm_policy: str | None = None

    def over(self, base: VgpuConfig) -> VgpuConfig:
        """This configuration with ``base``'s fields where this one sets none."""
        return VgpuConfig(
            priority=self.priority if self.priority is not None else base.priority,
            sm_policy=self.sm_policy if self.sm_policy is not None else base.sm_policy,
        )


@dataclass(frozen=True)
class Entry:
    """One of this driver's configuration entries: the requests it names (empty: all) and what it sets."""

    requests: tuple[str, ...]
    config: VgpuConfig

    def applies_to(self, request: str) -> bool:
        """Whether the entry configures ``request`` (``req`` or a subrequest's ``req/sub``): an
        entry naming the main request applies to each of its subrequests."""
        return not self.requests or request in self.requests or request.partition("/")[0] in self.requests


def parse_parameters(params: Any, field: str, source: str) -> VgpuConfig:
    """``opaque.parameters`` of an entry of this driver; ``ConfigEntryError`` naming the field."""
    if not isinstance(params, Mapping):
        raise ConfigEntryError(
            source, field, f"must be an object with apiVersion: {API_VERSION} and kind: {KIND}"
        )
    unknown = sorted(str(k) for k in params if k not in _FIELDS)
    if unknown:
        raise ConfigEntryError(
            source,
            f"{field}.{unknown[0]}",
            f"is not a field of {KIND}; it has {', '.join(_FIELDS)}",
        )
    if params.get("apiVersion") != API_VERSION:
        raise ConfigEntryError(
            source,
            f"{field}.apiVersion",
            f"must be {API_VERSION}, got {params.get('apiVersion')!r}",
        )
    if params.get("kind") != KIND:
        raise ConfigEntryError(source, f"{field}.kind", f"must be {KIND}, got {params.get('kind')!r}")
    priority = params.get("priority")
    if priority is not None and (type(priority) is not int or priority not in (0, 1)):
        raise ConfigEntryError(
            source,
            f"{field}.priority",
            f"must be 0 (high) or 1 (normal), as nvidia.com/priority, got {priority!r}",
        )
    policy = params.get("smPolicy")
    if policy is not None and policy not in SM_POLICIES:
        raise ConfigEntryError(
            source,
            f"{field}.smPolicy",
            f"must be cap (held to its cores) or elastic (may use idle SMs while alone), got {policy!r}",
        )
    return VgpuConfig(priority=priority, sm_policy=policy)


def check_entries(entries: Any, field: str, source: str) -> list[Entry]:
    """This driver's entries of a config list (``spec.devices.config``, a DeviceClass's
    ``spec.config`` or the allocation's), in order; others' are passed over.
    ``ConfigEntryError`` naming the field of the first malformed one."""
    if entries is None:
        return []
    if not isinstance(entries, Sequence) or isinstance(entries, (str, bytes)):
        raise ConfigEntryError(source, field, "must be a list")
    out: list[Entry] = []
    for i, entry in enumerate(entries):
        at = f"{field}[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigEntryError(source, at, "must be an object")
        opaque = entry.get("opaque")
        if not isinstance(opaque, Mapping) or opaque.get("driver") != DRIVER:
            continue
        requests = entry.get("requests") or []
        if not isinstance(requests, Sequence) or isinstance(requests, (str, bytes)):
            raise ConfigEntryError(source, f"{at}.requests", "must be a list of the claim's request names")
        if not all(isinstance(r, str) and r for r in requests):
            raise ConfigEntryError(source, f"{at}.requests", f"must name requests, got {list(requests)!r}")
        config = parse_parameters(opaque.get("parameters"), f"{at}.opaque.parameters", source)
        out.append(Entry(tuple(requests), config))
    return out


def for_request(entries: Sequence[Entry], request: str) -> VgpuConfig:
    """The configuration of ``request``: every entry that applies to it, a later one's fields
    over an earlier one's."""
    merged = VgpuConfig()
    for entry in entries:
        if entry.applies_to(request):
            merged = entry.config.over(merged)
    return merged
