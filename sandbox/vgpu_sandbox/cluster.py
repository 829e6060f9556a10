"""The sandbox: bring a real control plane up on 127.0.0.1, report on it, take it down.

All state lives in one folder (``state.json`` records the processes and ports), so any
``vgpu`` command, or a test run, can find and stop a sandbox that another one started.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vgpu.core.errors import KubeError
from vgpu.core.requests import RESOURCE_GPU
from vgpu_sandbox import binaries, controlplane, kubeconfig, nodes, pki, procs, product
from vgpu_sandbox.errors import SandboxError
from vgpu_sandbox.realnode import lifecycle, prechecks
from vgpu_sandbox.realnode.layout import COMPONENTS as REAL_NODE_COMPONENTS
from vgpu_sandbox.runtime import IDENTITIES as IDENTITIES
from vgpu_sandbox.runtime import Component as Component
from vgpu_sandbox.runtime import Handle, Spec, State
from vgpu_sandbox.runtime import default_dir as default_dir

__all__ = ["IDENTITIES", "Component", "Sandbox", "Spec", "State", "default_dir"]

MAX_SOCKET_PATH = 107


class Sandbox(Handle):
    """The whole sandbox: ``up`` starts it into ``state_dir``, ``status`` reports, ``down`` stops it."""

    # ---- up ------------------------------------------------------------------------
    def up(self, spec: Spec, progress: Callable[[str], None] = lambda _: None) -> float:
        """Start everything; on any failure stop what was started and raise. Returns seconds taken."""
        spec.validate()
        if self.is_running():
            raise SandboxError(
                f"a sandbox is already running from {self.state_dir} (pids {self.running_pids()}); "
                f"run `vgpu sandbox down` first, or give another folder with --dir"
            )
        self._check_socket_paths(spec)
        # No simulated nodes (--nodes 0, with the real node alone): no KWOK either.
        found = binaries.check_all(
            binaries.CONTROL_PLANE if spec.nodes else tuple(n for n in binaries.CONTROL_PLANE if n != "kwok")
        )
        if spec.product:
            found["kubectl"] = binaries.find("kubectl")
        if spec.apiserver_port:
            procs.check_port_free(spec.apiserver_port, "kube-apiserver", "--apiserver-port")
        if spec.real_node:
            reason = prechecks.why_not(spec.real_gpu)
            if reason:
                raise SandboxError(f"--real-node: {reason}")
        start = time.monotonic()
        self._reset_folder()
        self._state = State(spec=spec, started=time.time())
        parts = product.available() if spec.product else product.Parts(False, False)
        if not spec.local_scheduler:  # the chart's scheduler pod on the real node instead
            parts = product.Parts(extender=False, plugins=parts.plugins)
        try:
            self._start_control_plane(spec, found, progress, stand_ins=parts.plugins)
            if spec.nodes:
                self._create_nodes(spec, progress, advertise_gpus=not parts.plugins)
            product.start(self, spec, parts, progress)
            if spec.real_node:
                lifecycle.start(self, spec, progress)
            self._state.ready = True
            self._save()
        except BaseException:
            progress("start failed; stopping what was started")
            self._stop_everything()
            raise
        return time.monotonic() - start

    def _check_socket_paths(self, spec: Spec) -> None:
        """Each node's kubelet.sock lives under the state folder; unix socket paths have 107 bytes."""
        longest = self.layout.node_root(nodes.node_name(max(spec.nodes - 1, 0))) / nodes.KUBELET_SOCKET
        if len(str(longest).encode()) > MAX_SOCKET_PATH:
            raise SandboxError(
                f"the state folder {self.state_dir} is too deep: node sockets such as {longest} would pass "
                f"the {MAX_SOCKET_PATH}-byte limit of unix socket paths; choose a shorter --dir"
            )

    def _reset_folder(self) -> None:
        self.forget_clients()  # a new run: new ports, new credentials
        if self.state_dir.exists():
            shutil.rmtree(self.state_dir)
        self.state_dir.mkdir(parents=True, mode=0o700)
        for folder in (self.layout.pki, self.layout.logs, self.layout.config, self.layout.nodes):
            folder.mkdir(mode=0o700)

    def _start_control_plane(
        self, spec: Spec, found: dict[str, Path], progress: Callable[[str], None], stand_ins: bool
    ) -> None:
        layout = self.layout
        ca = self.ca = pki.CertificateAuthority(layout.pki)
        serving = ca.issue("apiserver", ["127.0.0.1", "localhost", "kubernetes", "kubernetes.default.svc"])
        kubelet_client = ca.issue("apiserver-kubelet-client", [], client=True)
        sa_key = pki.service_account_key(layout.pki / "service-account.key")
        tokens_csv = layout.config / "tokens.csv"
        tokens_csv.touch(mode=0o600)
        lines = []
        for identity, (user, group) in IDENTITIES.items():
            token = secrets.token_hex(16)
            lines.append(
                f'{token},{user},{identity}-uid,"{group}"' if group else f"{token},{user},{identity}-uid"
            )
        tokens_csv.write_text("\n".join(lines) + "\n")
        tokens = self._tokens()

        if spec.apiserver_port:
            self._state.ports["apiserver"] = spec.apiserver_port  # type: ignore[union-attr]
        api_port = self.port("apiserver")
        server = f"https://127.0.0.1:{api_port}"
        for identity, (user, _group) in IDENTITIES.items():
            target = layout.kubeconfig if identity == "admin" else layout.identity_kubeconfig(identity)
            kubeconfig.write(target, server=server, ca_pem=ca.pem, user=user, token=tokens[identity])

        progress("starting etcd")
        etcd_port, peer_port = self.port("etcd"), self.port("etcd-peer")
        self.launch("etcd", controlplane.etcd_argv(found["etcd"], layout, etcd_port, peer_port), etcd_port)
        self.wait_for("etcd to listen", lambda: procs.port_open(etcd_port), 30, "etcd")

        progress("starting kube-apiserver")
        self.launch(
            "kube-apiserver",
            controlplane.apiserver_argv(
                found["kube-apiserver"],
                layout,
                port=api_port,
                etcd_port=etcd_port,
                tls_cert=serving.cert,
                tls_key=serving.key,
                sa_key=sa_key,
                kubelet_client=(kubelet_client.cert, kubelet_client.key) if spec.real_node else None,
            ),
            api_port,
        )
        self.wait_for("kube-apiserver /readyz", lambda: self.api_get("/readyz") == "ok", 90, "kube-apiserver")

        kwok = " and KWOK" if "kwok" in found else ""
        progress(f"starting kube-controller-manager, kube-scheduler{kwok}")
        self.launch(
            "kube-controller-manager",
            controlplane.controller_manager_argv(
                found["kube-controller-manager"], layout, ca=ca.cert_path, sa_key=sa_key
            ),
        )
        sched_config = layout.config / "kube-scheduler.json"
        sched_config.write_text(controlplane.scheduler_config(layout.identity_kubeconfig("kube-scheduler")))
        self.launch("kube-scheduler", controlplane.scheduler_argv(found["kube-scheduler"], sched_config))
        if "kwok" in found:
            (layout.config / "kwok.yaml").write_text(nodes.kwok_config(stand_ins))
            kwok_port = self.port("kwok")
            self.launch("kwok", controlplane.kwok_argv(found["kwok"], layout, kwok_port), kwok_port)

        def default_sa() -> bool:
            return bool(self.api_get("/api/v1/namespaces/default/serviceaccounts/default"))

        self.wait_for(
            "the default ServiceAccount (kube-controller-manager)", default_sa, 60, "kube-controller-manager"
        )

    def _create_nodes(self, spec: Spec, progress: Callable[[str], None], advertise_gpus: bool) -> None:
        progress(f"creating {spec.nodes} simulated GPU nodes")
        gpu = nodes.GPUSpec(spec.gpus_per_node, spec.gpu_memory_mib, spec.gpu_model, spec.split)
        items = [nodes.manifest(nodes.node_name(i), gpu, advertise_gpus) for i in range(spec.nodes)]
        self.kubectl(
            "create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
        )

        def all_ready() -> bool:
            listed = self.api_get("/api/v1/nodes?labelSelector=gpu%3Don")
            ready = 0
            for item in listed.get("items", []):
                conditions = item.get("status", {}).get("conditions", [])
                taints = item.get("spec", {}).get("taints", []) or []
                if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions) and not any(
                    t.get("key") == "node.kubernetes.io/not-ready" for t in taints
                ):
                    ready += 1
            return ready >= spec.nodes

        self.wait_for(f"{spec.nodes} nodes to be Ready (KWOK)", all_ready, 60 + spec.nodes * 0.2, "kwok")

    # ---- status and down -------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """What runs. ``state`` is one of: ``none`` (never started here), ``stopped`` (by ``down``),
        ``healthy``, ``starting`` (``up`` under way, or killed before it finished), ``degraded``
        (a component died) and ``dead`` (every component gone without ``down``: a reboot, a kill).
        ``ok`` says whether nothing is wrong: true for none, stopped and healthy."""
        state = self.state()
        if state is None:
            return {
                "state": "none",
                "ok": True,
                "running": False,
                "healthy": False,
                "dir": str(self.state_dir),
                "components": [],
                "ports": {},
            }
        comps = [
            {"name": c.name, "pid": c.pid, "alive": procs.alive(c.pid), "port": c.port}
            for c in state.components
        ]
        running = any(c["alive"] for c in comps)
        healthy = state.ready and bool(comps) and all(c["alive"] for c in comps)
        if healthy:
            word = "healthy"
        elif not running:
            word = "stopped" if state.stopped else "dead"
        else:
            word = "starting" if not state.ready and not state.stopped else "degraded"
        report: dict[str, Any] = {
            "state": word,
            "ok": word in ("healthy", "stopped"),
            "running": running,
            "healthy": healthy,
            "dir": str(self.state_dir),
            "kubeconfig": str(self.kubeconfig),
            "started": state.started,
            "stopped": state.stopped,
            "spec": asdict(state.spec),
            "components": comps,
            # every port the sandbox chose, by what listens there (the metrics ports included)
            "ports": dict(state.ports),
        }
        if report["running"]:
            try:  # through the kubeconfig: this handle's recorded state (if any) is left alone
                listed = self.api_get("/api/v1/nodes")
                report["nodes"] = [
                    {
                        "name": n["metadata"]["name"],
                        "ready": any(
                            c["type"] == "Ready" and c["status"] == "True"
                            for c in n["status"].get("conditions", [])
                        ),
                        "gpus": n["status"].get("allocatable", {}).get(RESOURCE_GPU, "0"),
                    }
                    for n in listed.get("items", [])
                ]
            except (KubeError, KeyError) as err:
                report["nodes_error"] = str(err)
        return report

    def down(self) -> list[int]:
        """Stop every process of this sandbox, even after crashes; returns the pids it stopped."""
        pids = self.running_pids()
        self._stop_everything()
        return pids

    def _stop_everything(self) -> None:
        pids: set[int] = {p.pid for p in self._procs.values()}
        try:
            state = self._state or self.state()
        except SandboxError:
            state = None
        if state is not None:
            pids |= {c.pid for c in state.components}
            if state.spec.real_node:
                # Pods through the CRI first, while the API server still answers nothing new.
                lifecycle.stop(
                    self, {c.name: c.pid for c in state.components if c.name in REAL_NODE_COMPONENTS}
                )
        procs.stop_all(pids, self.state_dir)
        self.forget_clients()
        for proc in self._procs.values():
            try:
                proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        if state is not None and self.layout.state_file.exists():
            state.ready = False
            state.stopped = time.time()
            self.layout.state_file.write_text(state.to_json())
