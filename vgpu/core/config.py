"""Scheduler settings in one typed place.

Precedence, highest first: a command-line flag, an environment variable ``VGPU_<NAME>``
(``VGPU_DEFAULT_MEM``, ``VGPU_NODE_POLICY``...), a YAML or JSON file (``--config``, keys in
camelCase: ``defaultMem``, ``nodePolicy``...), then the defaults below. A bad value raises
:class:`vgpu.core.errors.ConfigError` naming where it came from.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from vgpu.core.boundary import Boundary
from vgpu.core.errors import ConfigError

BINPACK = "binpack"
SPREAD = "spread"
POLICIES = (BINPACK, SPREAD)

ENV_PREFIX = "VGPU_"


@dataclass(frozen=True)
class SchedulerConfig:
    """What the fit and the extender need to know.

    default_mem: MiB per vGPU when a container gives only ``nvidia.com/gpu``; 0 means the whole card.
    default_cores: percent of a card per vGPU when not given; 0 means no compute cap.
    node_policy / gpu_policy: cluster defaults, overridden per pod by annotation.
    reject_unsatisfiable: the validating webhook also denies a request larger than any card or
    node the cluster has now (more memory per vGPU than the largest card, more vGPUs in a
    container than any node's cards). Off by default: a cluster autoscaler or a batch queue adds
    such nodes after the pod exists, so the pod is admitted and waits Pending with the shortage
    in its scheduling reason. Requests no node could ever hold are denied either way.
    """

    default_mem: int = 0
    default_cores: int = 0
    node_policy: str = BINPACK
    gpu_policy: str = SPREAD
    scheduler_name: str = "vgpu-scheduler"
    namespace: str = "kube-system"
    # the extender process
    kubeconfig: str | None = None
    listen: str = "0.0.0.0:9443"
    metrics_listen: str = "0.0.0.0:9395"
    cert_file: str | None = None
    key_file: str | None = None
    # the CA whose certificates may call the scheduling verbs (filter, prioritize, bind): set, a
    # call without a client certificate it signed is refused; the webhooks and probes need none
    client_ca_file: str | None = None
    # threads: kube-scheduler binds asynchronously, and each bind holds a thread while the API
    # server answers (tens of ms under load); filter, on every pod's path, must not queue behind them
    workers: int = 32
    # the active-replica Lease of the extender, and how long a plugin Lease may go unrenewed
    leader_lease: str = "vgpu-scheduler-extender"
    identity: str = ""  # who holds the Lease; empty: the host name (the pod's name in a cluster)
    lease_duration_s: int = 15
    plugin_lease_grace_s: int = 5
    # admission: also deny what the cluster's present cards and nodes cannot hold (see above)
    reject_unsatisfiable: bool = False
    # the tenant boundary (vgpu.core.boundary, docs/security.md): the user names of the scheduler's
    # account (kube-scheduler and the extender) and of the device plugin's, whose writes of the
    # placement annotations the webhook lets through (empty: it does not check placements), and
    # the namespaces (comma-separated) whose pods and claims may ask for priority 0
    scheduler_account: str = ""
    node_agent_account: str = ""
    high_priority_namespaces: str = ""

    def __post_init__(self) -> None:
        _check(self)

    @cached_property
    def scheduling(self) -> SchedulingSettings:
        """The settings placement and admission decide by (what a second replica must share)."""
        return SchedulingSettings(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(SchedulingSettings)}
        )

    @cached_property
    def process(self) -> ProcessSettings:
        """The settings of the extender process itself (where it listens, its TLS, its threads, its
        Lease): none of them changes where a pod goes."""
        return ProcessSettings(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ProcessSettings)})

    @cached_property
    def boundary(self) -> Boundary:
        """The tenant boundary's rules (read once: the webhook asks at every review)."""
        return Boundary(
            scheduler=self.scheduler_account,
            node_agent=self.node_agent_account,
            high_priority_namespaces=_namespaces(self.high_priority_namespaces),
        )


@dataclass(frozen=True)
class SchedulingSettings:
    """:class:`SchedulerConfig`'s scheduling half: policies, defaults, admission, the boundary's names."""

    default_mem: int
    default_cores: int
    node_policy: str
    gpu_policy: str
    scheduler_name: str
    namespace: str
    plugin_lease_grace_s: int
    reject_unsatisfiable: bool
    scheduler_account: str
    node_agent_account: str
    high_priority_namespaces: str


@dataclass(frozen=True)
class ProcessSettings:
    """:class:`SchedulerConfig`'s process half: the API server, listening, TLS, threads, the Lease."""

    kubeconfig: str | None
    listen: str
    metrics_listen: str
    cert_file: str | None
    key_file: str | None
    client_ca_file: str | None
    workers: int
    leader_lease: str
    identity: str
    lease_duration_s: int


_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _namespaces(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


_INT_FIELDS = {
    "default_mem": 0,
    "default_cores": 0,
    "workers": 1,
    "lease_duration_s": 1,
    "plugin_lease_grace_s": 0,
}

_BOOL_FIELDS = ("reject_unsatisfiable",)
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


_FIELDS = {f.name: f for f in dataclasses.fields(SchedulerConfig)}
_BY_CAMEL = {_camel(n): n for n in _FIELDS}


def _check(cfg: SchedulerConfig) -> None:
    for name, minimum in _INT_FIELDS.items():
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError("settings", _camel(name), f"must be an integer >= {minimum}, got {value!r}")
    for name in _BOOL_FIELDS:
        value = getattr(cfg, name)
        if not isinstance(value, bool):
            raise ConfigError("settings", _camel(name), f"must be true or false, got {value!r}")
    if cfg.default_cores > 100:
        raise ConfigError(
            "settings", "defaultCores", f"must be 0..100 (percent of a card), got {cfg.default_cores}"
        )
    for ns in _namespaces(cfg.high_priority_namespaces):
        if len(ns) > 63 or not _NAMESPACE.match(ns):
            raise ConfigError(
                "settings",
                "highPriorityNamespaces",
                f"{ns!r} is not a namespace name (lower-case letters, digits and '-'); "
                "give names separated by commas",
            )
    for name in ("node_policy", "gpu_policy"):
        if getattr(cfg, name) not in POLICIES:
            raise ConfigError(
                "settings", _camel(name), f"must be one of {', '.join(POLICIES)}, got {getattr(cfg, name)!r}"
            )


def _coerce(source: str, key: str, name: str, value: Any) -> Any:
    if name in _INT_FIELDS:
        if isinstance(value, bool):
            raise ConfigError(source, key, f"must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        try:
            return int(str(value).strip())
        except ValueError as err:
            raise ConfigError(source, key, f"must be an integer, got {value!r}") from err
    if name in _BOOL_FIELDS:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ConfigError(source, key, f"must be true or false, got {value!r}")
    if value is None:
        return None
    if not isinstance(value, str | int | float):
        raise ConfigError(source, key, f"must be a string, got {type(value).__name__}")
    return str(value)


def load_config(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    file: str | Path | None = None,
) -> SchedulerConfig:
    """Merge settings: ``flags`` (snake_case names, None = not given) > ``env`` > ``file`` > defaults."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    if file is not None:
        values.update(_from_file(Path(file)))
    for name in _FIELDS:
        var = ENV_PREFIX + name.upper()
        if var in env and env[var] != "":
            values[name] = _coerce(var, var, name, env[var])
    for name, value in (flags or {}).items():
        if name not in _FIELDS:
            raise ConfigError("flags", name, f"unknown setting; known: {', '.join(sorted(_FIELDS))}")
        if value is not None:
            values[name] = _coerce("flag", "--" + name.replace("_", "-"), name, value)
    try:
        return SchedulerConfig(**values)
    except ConfigError as err:
        where = _origin(err.field, file, env, flags or {})
        raise ConfigError(where, err.field, err.message) from err


def _origin(camel: str, file: str | Path | None, env: Mapping[str, str], flags: Mapping[str, Any]) -> str:
    name = _BY_CAMEL.get(camel, camel)
    if flags.get(name) is not None:
        return "flag --" + name.replace("_", "-")
    if env.get(ENV_PREFIX + name.upper()):
        return "environment " + ENV_PREFIX + name.upper()
    return f"file {file}" if file is not None else "settings"


def _from_file(path: Path) -> dict[str, Any]:
    source = f"file {path}"
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ConfigError(source, "", f"cannot read it ({err.strerror})") from err
    except yaml.YAMLError as err:
        raise ConfigError(source, "", f"not valid YAML/JSON ({err})") from err
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(source, "", "must be a mapping of setting names to values")
    out: dict[str, Any] = {}
    for key, value in doc.items():
        name = _BY_CAMEL.get(str(key))
        if name is None:
            raise ConfigError(source, str(key), f"unknown setting; known: {', '.join(sorted(_BY_CAMEL))}")
        out[name] = _coerce(source, str(key), name, value)
    return out
