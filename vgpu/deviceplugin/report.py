"""Contract 2 from the node: the inventory annotation (written only when it changes) and the Lease."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from vgpu.core.annotations import (
    DEVICES_ANNOTATION,
    LEASE_HOLDER_PREFIX,
    USAGE_ANNOTATION,
    encode_devices,
    lease_name,
)
from vgpu.core.backoff import Backoff
from vgpu.core.errors import KubeError
from vgpu.core.gpumode import device_plugin_refusal
from vgpu.core.service import Service
from vgpu.node.devices import DeviceState

log = logging.getLogger(__name__)


class NodeAPI(Protocol):
    def node_annotations(self, node: str) -> dict[str, str]: ...

    def node_labels(self, node: str) -> dict[str, str]: ...

    def patch_node_annotations(self, node: str, annotations: Mapping[str, str | None]) -> None: ...

    def renew_lease(
        self,
        namespace: str,
        name: str,
        holder: str,
        duration_s: int,
        annotations: Mapping[str, str] | None = None,
    ) -> None: ...


class NodeReporter:
    """Publishes the inventory and renews the Lease ``vgpu-<node>`` every ``renew_s``."""

    def __init__(
        self,
        node: str,
        namespace: str,
        state: DeviceState,
        api: NodeAPI,
        lease_duration_s: int = 40,
        renew_s: float = 10.0,
        usage: Callable[[], dict[str, dict[str, int]]] | None = None,
        more: Callable[[], dict[str, str]] | None = None,
    ) -> None:
        self.node = node
        self.namespace = namespace
        self.state = state
        self.api = api
        self.lease_duration_s = lease_duration_s
        self.renew_s = renew_s
        self.usage = usage
        self.more = more  # further Lease annotations (the node monitor's: lines, media engines)
        self._service = Service("dp-report", lambda _stop: self._loop())
        self._stop = self._service.stopping
        self._published: str | None = None
        self.writes = 0  # annotation writes, for tests and logs
        self.failures = 0  # failed reports, for tests
        # after a failed report: 1 s, doubling to 30 s (under the Lease's 40 s), reset when one works
        self._backoff = Backoff(1.0, 30.0)

    def check_mode(self) -> None:
        """One mode per node: on a node whose label gives its cards to DRA, offer none (and say
        why, once per change); offer them again when the label says device-plugin."""
        why = device_plugin_refusal(self.api.node_labels(self.node))
        if not self.state.withhold(why):
            return
        if why is not None:
            log.warning(
                "node %s %s; this device plugin advertises no vGPUs there and its inventory lists "
                "no card (the chart's DaemonSet keeps off such nodes)",
                self.node,
                why,
            )
        else:
            log.info("node %s is a device-plugin node again: advertising its vGPUs", self.node)

    def publish(self) -> bool:
        """Write the inventory unless the Node carries this exact text; returns whether it wrote."""
        text = encode_devices(self.state.inventory())
        if text == self._published:
            return False
        current = self.api.node_annotations(self.node).get(DEVICES_ANNOTATION)
        if current != text:
            self.api.patch_node_annotations(self.node, {DEVICES_ANNOTATION: text})
            self.writes += 1
            log.info("published the inventory of node %s", self.node)
        self._published = text
        return current != text

    def renew(self) -> None:
        """Renew the Lease, with the containers' memory use as the regions hold it now."""
        annotations = None
        if self.usage is not None:
            try:
                annotations = {
                    USAGE_ANNOTATION: json.dumps(self.usage(), sort_keys=True, separators=(",", ":"))
                }
            except OSError as err:  # the state folder unreadable: renew without the report
                log.warning("could not read the containers' usage for the Lease: %s", err)
        if self.more is not None:
            try:
                annotations = {**(annotations or {}), **self.more()}
            except OSError as err:
                log.warning("could not read the containers' lines for the Lease: %s", err)
        self.api.renew_lease(
            self.namespace,
            lease_name(self.node),
            LEASE_HOLDER_PREFIX + self.node,
            self.lease_duration_s,
            annotations,
        )

    def run_once(self) -> None:
        self.check_mode()
        self.publish()
        self.renew()

    def start(self) -> None:
        self.run_once()  # fail at start, loudly, when the API server refuses us
        self._service.start()

    def _loop(self) -> None:
        seen = self.state.version
        next_renew = time.monotonic() + self.renew_s
        said = ""  # the failure last logged: each is said once, not at every retry
        while not self._stop.is_set():
            seen = self.state.wait_change(seen, 1.0)
            if self._stop.is_set():
                return
            try:
                self.publish()
                if time.monotonic() >= next_renew:
                    self._published = None  # re-read the Node now and then: someone may have removed it
                    self.check_mode()
                    self.publish()
                    self.renew()
                    next_renew = time.monotonic() + self.renew_s
            except KubeError as err:
                self._published = None
                self.failures += 1
                why = self.failure(err)
                if why != said:
                    log.warning(
                        "%s; retrying after %.0f s, then less often, up to every %.0f s",
                        why,
                        self._backoff.current_s,
                        self._backoff.max_s,
                    )
                    said = why
                if self._stop.wait(self._backoff.next()):
                    return
                continue
            if said:
                log.info("reporting node %s works again", self.node)
                said = ""
            self._backoff.reset()

    def failure(self, err: KubeError) -> str:
        """What is wrong, and what to do, in one line."""
        if err.status == 404 and f"node {self.node}" in str(err):  # read or annotate node <name>
            return (
                f"node {self.node} does not exist (deleted?): this device plugin cannot publish its cards, "
                "and no vGPU pod is placed there. If the machine left the cluster, stop the plugin there "
                "(or remove the machine); if it stays, restart its kubelet, which registers the Node again, "
                "and the plugin publishes on its own"
            )
        if err.status == 403:
            return (
                f"reporting node {self.node} was refused ({err}): the plugin's ServiceAccount needs the "
                "chart's RBAC (get and patch its Node, its Lease)"
            )
        return f"reporting node {self.node} failed ({err})"

    def stop(self) -> None:
        self._stop.set()
        self.state.kick()  # wakes its wait for a change of the cards
        self._service.stop()
