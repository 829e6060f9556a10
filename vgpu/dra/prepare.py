"""NodePrepareResources and NodeUnprepareResources: a claim's shares made into host files.

For each request of a prepared claim the plugin writes what the device plugin's Allocate writes
for a container (contract 4, docs/contracts.md), named so that nothing of the device plugin can
collide with it (``dra_<claim-uid>_<request>``, never a pod UID):

    <state-dir>/grants/dra_<claim-uid>_<request>.limits   the grant (contract 5), mounted read-only
    <state-dir>/grants/dra_<claim-uid>_<request>.hook     the hook version handed out (hooklib.py)
    <state-dir>/containers/dra_<claim-uid>_<request>/     the region folder, mounted read-write
    <cdi-dir>/vgpu.openaios.io-claim_<claim-uid>.json      the CDI spec: one device per request
    <state-dir>/dra/claims/<claim-uid>.json               the claim's record (contract 7)
    <state-dir>/dra/checkpoint.json                       the answer given, by claim UID

Every container given a claim's request shares its region and grant: the request's memory and
cores are held across all of them, as a claim shared between containers shares its device.

Idempotent: a claim in the checkpoint is answered from it, nothing written again; a plugin
killed half way leaves files the next prepare of the claim writes over (the checkpoint, written
last, is what says a claim is prepared). Unprepare removes the files the checkpoint names, or,
for a claim it does not know, whatever carries the claim's UID.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from vgpu.core.claimconfig import VgpuConfig
from vgpu.core.drarecord import encode_record, record_path, request_entry
from vgpu.dra import cdi
from vgpu.dra.claims import RESULTS, ClaimError, ClaimPlan, Share, plan
from vgpu.dra.mig import Held, MigNode, MigView, held_of
from vgpu.dra.prepare_mps import check_sharing
from vgpu.dra.slices import device_name
from vgpu.dra.state import Checkpoint
from vgpu.hookabi.grant import GRANT_SUFFIX
from vgpu.hookabi.layout import GRANT_PATH_IN_CONTAINER, MPS_PIPE_IN_CONTAINER
from vgpu.node import folders, inject
from vgpu.node.config import NodeConfig
from vgpu.node.discovery import Card
from vgpu.node.driver import DriverFiles
from vgpu.node.grants import limits, write_grant_file
from vgpu.node.hooklib import RECORD_SUFFIX, HookInstall, hand_out
from vgpu.node.paths import CONTAINER_HOOK_PATH, DRA_PREFIX, REGION_FILE_NAME, HostPaths

log = logging.getLogger(__name__)

# A request whose claim and class configure no priority (contract 8) gets the device plugin's default.
PRIORITY = 1


@dataclass(frozen=True)
class StatePaths(HostPaths):
    """The device plugin's host paths with ``--state-dir`` as its ``/var/lib/vgpu``."""

    state_dir: Path = Path("/var/lib/vgpu")

    @property
    def vgpu_dir(self) -> Path:
        return self.state_dir


class ClaimSource(Protocol):
    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any] | None: ...


def folder_name(claim_uid: str, request: str) -> str:
    return f"{DRA_PREFIX}_{claim_uid}_{cdi.safe(request)}"


def folder_inside(folder: str) -> str:
    """The region folder as the container sees it."""
    return f"/var/lib/vgpu/containers/{folder}"


class Preparer:
    """Prepares and unprepares claims on one node; safe to call from several gRPC threads."""

    def __init__(
        self,
        node: str,
        paths: StatePaths,
        cdi_dir: Path,
        config: NodeConfig,
        claims: ClaimSource,
        cards: Callable[[], list[Card]],
        hook: HookInstall | None = None,
        driver: DriverFiles | None = None,
        checkpoint: Checkpoint | None = None,
        mig: MigNode | None = None,
        sharing: str = "timeslice",
    ) -> None:
        self.node = node
        self.paths = paths
        self.cdi_dir = cdi_dir
        self.config = config
        self.claims = claims
        self.cards = cards
        self.hook = hook
        self.driver = driver
        self.checkpoint = checkpoint or Checkpoint(paths.state_dir)
        self.mig = mig  # --mig dynamic: the cards in MIG mode, as partitionable devices (dra/mig.py)
        self.sharing = sharing  # --sharing-mode: the whole cards' mode (mps: prepare_mps.py)
        self._lock = threading.Lock()
        self._caps: dict[str, list[str]] = {}  # MIG device uuid -> its /dev/nvidia-caps nodes
        self.writes = 0  # claims prepared from the API server (not from the checkpoint): tests, logs

    def _healthy(self, partitioned: Collection[str] = ()) -> dict[str, Card]:
        return {device_name(c.index): c for c in self.cards() if c.healthy and c.uuid not in partitioned}

    def _held(self) -> dict[tuple[str, int], str]:
        return held_of({**e, "uid": uid} for uid, e in self.prepared().items())

    def mig_view(self) -> MigView | None:
        """Reclaim the MIG instances no prepared claim holds, then what the MIG cards offer
        (the publisher's view of them); None without ``--mig dynamic``."""
        if self.mig is None:
            return None
        with self._lock:
            cards = self.cards()
            held = self._held()
            self.mig.reconcile(cards, held)
            return self.mig.view(cards, held)

    def prepare(self, namespace: str, uid: str, name: str) -> list[dict[str, Any]]:
        """The claim's devices for the kubelet (``requestNames``, ``poolName``, ``deviceName``,
        ``cdiDeviceIDs``); ``ClaimError`` naming the field, ``KubeError``, ``OSError``."""
        with self._lock:
            done = self.checkpoint.get(uid)
            if done is not None:
                return list(done["devices"])
            claim = self.claims.get_resource_claim(namespace, name)
            if claim is None:
                raise ClaimError(f"ResourceClaim {namespace}/{name}", "", "not found in the API server")
            view = self.mig.view(self.cards(), self._held()) if self.mig is not None else None
            claim_plan = plan(
                claim,
                uid,
                self._healthy(view.partitioned if view else ()),
                self.node,
                self.config.device_memory_scaling,
                view.slots.keys() if view else (),
            )
            held: list[Held] = []
            if claim_plan.mig and view is not None and self.mig is not None:
                claim_plan, held = self._take_mig(claim_plan, view)
            try:
                devices, folders = self._write(claim_plan)
            except BaseException:
                if held and self.mig is not None:
                    self.mig.release(held, f"ResourceClaim {namespace}/{name}")
                raise
            entry: dict[str, Any] = {
                "namespace": namespace,
                "name": name,
                "devices": devices,
                "folders": folders,
            }
            if held:
                entry["mig"] = [h.as_json() for h in held]
            self.checkpoint.put(uid, entry)
            self.writes += 1
            log.info(
                "prepared ResourceClaim %s/%s (%s): %s",
                namespace,
                name,
                uid,
                ", ".join(
                    f"{s.request} {s.device} {s.memory_mib}Mi {s.cores}% priority {c.priority} {c.sm_policy}"
                    for s in claim_plan.shares
                    if (c := self._config(claim_plan, s.request))
                ),
            )
            return devices

    def _take_mig(self, claim_plan: ClaimPlan, view: MigView) -> tuple[ClaimPlan, list[Held]]:
        """The claim's MIG instances found or made, its MIG results turned into whole-slice
        shares (the grant: the slice's memory, all its compute)."""
        assert self.mig is not None
        wanted = [view.slots[device] for _, device in claim_plan.mig]
        for slot in wanted:
            if not slot.card.healthy:
                raise ClaimError(
                    f"ResourceClaim {claim_plan.namespace}/{claim_plan.name}",
                    RESULTS,
                    f"{slot.device} is on card {slot.card.uuid}, which is unhealthy: delete the pod and "
                    "its claim so that the scheduler allocates again",
                )
        got = self.mig.take(wanted, self._held(), claim_plan.uid)
        shares = tuple(
            Share(
                request=request,
                device=slot.device,
                uuid=d.uuid,
                index=slot.card.index,
                minor=slot.card.minor if slot.card.minor >= 0 else slot.card.index,
                memory_mib=d.memory_mib,
                cores=100,
            )
            for (request, _), (slot, d) in zip(claim_plan.mig, got, strict=True)
        )
        self._caps.update(
            {
                d.uuid: [f"/dev/nvidia-caps/nvidia-cap{m}" for m in (d.gi_minor, d.ci_minor) if m >= 0]
                for _, d in got
            }
        )
        held = [
            Held(slot.card.uuid, d.gpu_instance, d.uuid, slot.device, slot.profile.name, slot.placement.start)
            for slot, d in got
        ]
        return dataclasses.replace(claim_plan, shares=claim_plan.shares + shares), held

    def _write(self, claim_plan: ClaimPlan) -> tuple[list[dict[str, Any]], list[str]]:
        uid = claim_plan.uid
        edits: dict[str, cdi.Edits] = {}
        devices: list[dict[str, Any]] = []
        folders: list[str] = []
        requests: list[dict[str, Any]] = []
        mig = {r for r, _ in claim_plan.mig}
        for request, shares in claim_plan.requests().items():
            folder = folder_name(uid, request)
            folders.append(folder)
            config = self._config(claim_plan, request)
            sharing = "timeslice" if request in mig else self.sharing  # a MIG slice is never MPS
            check_sharing(claim_plan, request, shares, config, sharing, self.paths)
            edits[request] = self._request_files(folder, shares, config, sharing == "mps")
            for j, share in enumerate(shares):
                devices.append(
                    {
                        "requestNames": [request],
                        "poolName": self.node,
                        "deviceName": share.device,
                        # one CDI device per request carries all its cards; the kubelet needs it
                        # once (and, with driverInject cdi, each card's device of the node's spec)
                        "cdiDeviceIDs": ([cdi.device_id(uid, request)] if j == 0 else [])
                        + (
                            inject.cdi_names(self.config.cdi_kind, [share.uuid])
                            if self.config.driver_inject == "cdi"
                            else []
                        ),
                    }
                )
                requests.append(
                    request_entry(
                        request=request,
                        device=share.device,
                        uuid=share.uuid,
                        memory_mib=share.memory_mib,
                        cores=share.cores,
                        share_id=share.share_id,
                        priority=config.priority,
                        sm_policy=config.sm_policy,
                        grant=self.paths.grant(folder),
                        region_dir=self.paths.containers_dir / folder,
                    )
                )
        cdi.write_json(cdi.spec_path(self.cdi_dir, uid), cdi.spec(uid, edits))
        record = encode_record(
            namespace=claim_plan.namespace,
            name=claim_plan.name,
            uid=uid,
            node=self.node,
            reserved_for=claim_plan.reserved_for,
            requests=requests,
        )
        cdi.write_json(record_path(self.paths.state_dir, uid), record)
        return devices, folders

    def _config(self, claim_plan: ClaimPlan, request: str) -> VgpuConfig:
        """The request's configuration with every field set: the claim's and its class's
        entries, the defaults (priority 1, the node config's SM policy) where they set none."""
        return claim_plan.config(request).over(VgpuConfig(PRIORITY, self.config.sm_policy))

    def _request_files(
        self, folder: str, shares: list[Share], config: VgpuConfig, mps: bool = False
    ) -> cdi.Edits:
        """One request's region folder, grant and hook record on the host, and its CDI edits;
        ``config`` is the request's, its fields resolved (the node config's where the claim set none)."""
        nodes: list[str] = []
        if self.driver is not None:
            try:
                nodes = [d.container_path for d in self.driver.devices([s.minor for s in shares])]
                nodes += [c for s in shares for c in self._caps.get(s.uuid, [])]  # a MIG device's caps
            except FileNotFoundError as err:
                raise ClaimError(
                    f"node {self.node}",
                    "",
                    f"driverInject is plugin but {err} is missing: load the NVIDIA driver's modules "
                    "(nvidia-modprobe) or fix the node's /dev",
                ) from err
        inside = folder_inside(folder)
        host_dir = self.paths.containers_dir / folder
        folders.make(host_dir, self.config.container_folder)  # as the device plugin's (plugin/folders.py)
        node_config = dataclasses.replace(self.config, sm_policy=config.sm_policy or self.config.sm_policy)
        # mps: the card's MPS daemon's client (docs/dra.md#mps-shares), as the device plugin's
        env, grant = limits(shares, node_config, f"{inside}/{REGION_FILE_NAME}", str(config.priority), mps)
        grant_file = write_grant_file(self.paths, folder, grant)
        hand_out(self.paths, folder, self.hook)
        mounts: list[tuple[str, str, bool]] = [
            (inside, str(host_dir), False),
            (GRANT_PATH_IN_CONTAINER, str(grant_file), True),
        ]
        if mps:
            mounts.append((MPS_PIPE_IN_CONTAINER, str(self.paths.mps_pipe(shares[0].uuid)), True))
        if self.hook is not None:
            mounts += [
                (CONTAINER_HOOK_PATH, str(self.hook.library), True),
                ("/etc/ld.so.preload", str(self.hook.preload), True),
            ]
        if self.driver is not None:
            mounts += [(m.container_path, m.host_path, True) for m in self.driver.mounts()]
        if self.config.driver_inject == "runtime":  # NVIDIA's toolkit, by volume mounts (plugin/inject.py)
            mounts += [(c, h, True) for c, h in inject.volume_mounts([s.uuid for s in shares])]
        return cdi.Edits(env=env, mounts=mounts, device_nodes=nodes)

    def unprepare(self, uid: str) -> None:
        """Remove what prepare made for the claim (nothing to remove is no error); ``OSError``."""
        with self._lock:
            entry = self.checkpoint.get(uid)
            held = [h for doc in (entry or {}).get("mig") or [] if (h := Held.from_json(doc)) is not None]
            if entry is not None and held and self.mig is not None:  # first: a slice in use stays prepared
                self.mig.release(held, f"ResourceClaim {entry['namespace']}/{entry['name']}")
            prefix = f"{DRA_PREFIX}_{uid}_"
            names = set(entry["folders"] if entry else [])
            for where in (self.paths.containers_dir, self.paths.grants_dir):
                with contextlib.suppress(FileNotFoundError):
                    names.update(
                        p.name.removesuffix(GRANT_SUFFIX).removesuffix(RECORD_SUFFIX)
                        for p in where.iterdir()
                        if p.name.startswith(prefix)
                    )
            for folder in sorted(names):
                folders.remove(self.paths.containers_dir / folder)
                for path in (self.paths.grant(folder), self.paths.grants_dir / f"{folder}{RECORD_SUFFIX}"):
                    path.unlink(missing_ok=True)
            cdi.spec_path(self.cdi_dir, uid).unlink(missing_ok=True)
            record_path(self.paths.state_dir, uid).unlink(missing_ok=True)
            self.checkpoint.remove(uid)
            if entry is not None:
                log.info("unprepared ResourceClaim %s/%s (%s)", entry["namespace"], entry["name"], uid)

    def prepared(self) -> Mapping[str, dict[str, Any]]:
        return {uid: e for uid in self.checkpoint.uids() if (e := self.checkpoint.get(uid)) is not None}
