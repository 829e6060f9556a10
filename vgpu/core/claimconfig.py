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
        sharing: mps                # timeslice or mps: the card's mode the request must get

The scheduler copies the class's entries and then the claim's into
``status.allocation.devices.config`` (``source: FromClass`` / ``FromClaim``), in that order; a
later entry's field wins over an earlier one's, so a claim overrides its class. Entries of other
drivers are not ours to judge and are passed over.

Pure: the admission webhook checks a claim or template with :func:`check_entries` when it is
written, and the DRA plugin resolves each request's configuration with :func:`for_request` when
it prepares the claim (checking again: a claim written while the webhook was away).

:func:`check_capacity` judges what a claim's requests of the DeviceClass ``vgpu.openaios.io``
(or ``mps.vgpu.openaios.io``) ask of a card: ``cores`` past 100 no card can ever give (an error,
so admission refuses it rather than the claim waiting Pending with no reason of its own), and
``memory`` under 1Mi, a byte count where MiB were surely meant (a warning: the request policy
rounds it up to 1Mi).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from vgpu.core.errors import FieldError
from vgpu.core.quantity import quantity_value, shown

# The DRA driver's name (contract 8's owner, docs/contracts.md): its DeviceClass's name, the CDI
# vendor of its specs (vgpu.dra.cdi), its kubelet folder and registration socket (vgpu.dra.server).
DRIVER = "vgpu.openaios.io"
API_VERSION = f"{DRIVER}/v1"
KIND = "VgpuConfig"
MPS_CLASS = f"mps.{DRIVER}"  # the DeviceClass of shares of cards the node shares through MPS
SM_POLICIES = ("cap", "elastic")
SHARINGS = ("timeslice", "mps")  # a card's mode, as the slice's attribute ``sharing`` says it
_FIELDS = ("apiVersion", "kind", "priority", "smPolicy", "sharing")


class ConfigEntryError(FieldError):
    """An entry of this driver's opaque configuration that is malformed; ``field`` is its path."""


@dataclass(frozen=True)
class VgpuConfig:
    """What a request of a claim is configured with; None: not set (the default applies)."""

    priority: int | None = None
    sm_policy: str | None = None
    sharing: str | None = None  # the card's mode the request must be prepared on (SHARINGS)

    def over(self, base: VgpuConfig) -> VgpuConfig:
        """This configuration with ``base``'s fields where this one sets none."""
        return VgpuConfig(
            priority=self.priority if self.priority is not None else base.priority,
            sm_policy=self.sm_policy if self.sm_policy is not None else base.sm_policy,
            sharing=self.sharing if self.sharing is not None else base.sharing,
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
    sharing = params.get("sharing")
    if sharing is not None and sharing not in SHARINGS:
        raise ConfigEntryError(
            source,
            f"{field}.sharing",
            f"must be timeslice (a card time-sliced under the hook) or mps (a card shared through MPS, "
            f"DeviceClass {MPS_CLASS}), got {sharing!r}",
        )
    return VgpuConfig(priority=priority, sm_policy=policy, sharing=sharing)


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


CARD_CORES = 100
MIB = 1 << 20


def _number(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{float(value):g}"


def _capacity(requests: Any, at: str, source: str, warnings: list[str]) -> None:
    """One request's ``capacity.requests`` of the class vgpu.openaios.io."""
    if not isinstance(requests, Mapping):
        return
    if "cores" in requests:
        cores = quantity_value(requests["cores"])
        if cores is not None and cores > CARD_CORES:
            raise ConfigEntryError(
                source,
                f"{at}.cores",
                f"asks for {_number(cores)} percent of one card, and a card has {CARD_CORES}: "
                f"no node can ever allocate it. Ask for 1 to {CARD_CORES} (or count: 2 for two cards)",
            )
    if "memory" in requests:
        memory = quantity_value(requests["memory"])
        if memory is not None and 0 < memory < MIB:
            # the number as bytes: the API server has made "3000" into "3k" by now
            text = str(requests["memory"]).strip()
            warnings.append(
                f"{source}: {at}.memory: {shown(text)} is {_number(memory)} bytes, less than 1Mi; "
                f"the card's request policy gives it 1Mi. Did you mean {_number(memory)}Mi?"
            )


def check_capacity(requests: Any, field: str, source: str) -> list[str]:
    """The capacity the requests (``spec.devices.requests``) ask of the class ``vgpu.openaios.io``,
    in ``exactly`` and in each ``firstAvailable`` subrequest: the warnings to give;
    ``ConfigEntryError`` naming the field for one no card could ever hold."""
    warnings: list[str] = []
    if not isinstance(requests, Sequence) or isinstance(requests, (str, bytes)):
        return warnings
    for i, request in enumerate(requests):
        if not isinstance(request, Mapping):
            continue
        choices: list[tuple[str, Any]] = [(f"{field}[{i}].exactly", request.get("exactly"))]
        subs = request.get("firstAvailable")
        if isinstance(subs, Sequence) and not isinstance(subs, (str, bytes)):
            choices += [(f"{field}[{i}].firstAvailable[{j}]", sub) for j, sub in enumerate(subs)]
        for at, choice in choices:
            if isinstance(choice, Mapping) and choice.get("deviceClassName") in (DRIVER, MPS_CLASS):
                capacity = choice.get("capacity")
                if isinstance(capacity, Mapping):
                    _capacity(capacity.get("requests"), f"{at}.capacity.requests", source, warnings)
    return warnings
