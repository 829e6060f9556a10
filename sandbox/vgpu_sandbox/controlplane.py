"""Command lines and configuration files of the control-plane components.

Pure functions of the sandbox's layout and ports, so they can be read and tested alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.244.0.0/16"


@dataclass(frozen=True)
class Layout:
    """Where everything of one sandbox lives under its state folder."""

    root: Path

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def etcd_data(self) -> Path:
        return self.root / "etcd"

    @property
    def config(self) -> Path:
        return self.root / "config"

    @property
    def nodes(self) -> Path:
        return self.root / "nodes"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    def node_root(self, node: str) -> Path:
        return self.nodes / node

    def identity_kubeconfig(self, identity: str) -> Path:
        return self.config / f"{identity}.kubeconfig"


def etcd_argv(etcd: Path, layout: Layout, client_port: int, peer_port: int) -> list[str]:
    peer = f"http://127.0.0.1:{peer_port}"
    client = f"http://127.0.0.1:{client_port}"
    return [
        str(etcd),
        "--name=sandbox",
        f"--data-dir={layout.etcd_data}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=sandbox={peer}",
        "--initial-cluster-state=new",
        "--snapshot-count=10000",
        "--quota-backend-bytes=4294967296",
        "--log-level=warn",
    ]


def apiserver_argv(
    binary: Path,
    layout: Layout,
    *,
    port: int,
    etcd_port: int,
    tls_cert: Path,
    tls_key: Path,
    sa_key: Path,
    kubelet_client: tuple[Path, Path] | None = None,
) -> list[str]:
    # To kubelets (logs, exec): a client certificate they verify, and their serving certificate
    # verified against the sandbox's CA (the real node's kubelet has one from it).
    to_kubelets = (
        [
            f"--kubelet-client-certificate={kubelet_client[0]}",
            f"--kubelet-client-key={kubelet_client[1]}",
            f"--kubelet-certificate-authority={layout.pki / 'ca.crt'}",
            # Node names resolve nowhere here; the node's address does.
            "--kubelet-preferred-address-types=InternalIP,Hostname",
        ]
        if kubelet_client
        else []
    )
    return [
        str(binary),
        *to_kubelets,
        f"--etcd-servers=http://127.0.0.1:{etcd_port}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--secure-port={port}",
        f"--tls-cert-file={tls_cert}",
        f"--tls-private-key-file={tls_key}",
        f"--cert-dir={layout.pki}",
        f"--token-auth-file={layout.config / 'tokens.csv'}",
        "--authorization-mode=RBAC",
        f"--service-account-key-file={sa_key}",
        f"--service-account-signing-key-file={sa_key}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--allow-privileged=true",
        # Pods asking for nvidia.com/gpu tolerate the taint GPU nodes carry (the real node's).
        "--enable-admission-plugins=ExtendedResourceToleration",
        # No kube-proxy: the API server calls webhooks behind a Service (the chart's, in a pod on
        # the real node) at the Service's ready endpoint, not at its unroutable cluster IP.
        "--enable-aggregator-routing=true",
        # Watch-list streams (beta, on by default from 1.32) need etcd's progress requests, which
        # Debian 12's etcd 3.4.23 cannot serve: with the gate on, the clients' informers (KWOK's,
        # the controllers') wait about a minute on each stream before they fall back to list and
        # watch. Off, the server tells them at once and they list and watch from the start.
        "--feature-gates=WatchList=false",
        "--profiling=false",
        "--max-requests-inflight=800",
        "--max-mutating-requests-inflight=400",
        "--event-ttl=30m",
        "--v=1",
    ]


def controller_manager_argv(binary: Path, layout: Layout, *, ca: Path, sa_key: Path) -> list[str]:
    return [
        str(binary),
        f"--kubeconfig={layout.identity_kubeconfig('kube-controller-manager')}",
        "--leader-elect=false",
        "--secure-port=0",
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={sa_key}",
        f"--root-ca-file={ca}",
        f"--cluster-cidr={POD_CIDR}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--controllers=*,-nodeipam,-cloud-node-lifecycle,-service-lb-controller,-route",
        "--kube-api-qps=200",
        "--kube-api-burst=400",
        "--node-monitor-grace-period=40s",
        "--v=1",
    ]


def scheduler_config(
    kubeconfig: Path,
    *,
    scheduler_name: str = "default-scheduler",
    extender_url: str | None = None,
    extender_ca_b64: str | None = None,
    extender_client: tuple[Path, Path] | None = None,
    managed_resources: tuple[str, ...] = (),
    percentage_of_nodes_to_score: int | None = None,
    client_qps: int = 200,
) -> str:
    """A KubeSchedulerConfiguration (v1) as JSON, optionally calling the vGPU extender over TLS
    (``extender_client``: the client certificate and key kube-scheduler gives it).

    ``client_qps``: kube-scheduler's own API client rate (burst twice that). It limits the binds
    kube-scheduler makes itself, not those the extender makes.
    """
    profile: dict[str, object] = {"schedulerName": scheduler_name}
    if percentage_of_nodes_to_score is not None:
        profile["percentageOfNodesToScore"] = percentage_of_nodes_to_score
    config: dict[str, object] = {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig), "qps": client_qps, "burst": 2 * client_qps},
        "leaderElection": {"leaderElect": False},
        "podInitialBackoffSeconds": 1,
        "podMaxBackoffSeconds": 5,
        "profiles": [profile],
    }
    if extender_url is not None:
        tls: dict[str, object] = {"insecure": False, "caData": extender_ca_b64}
        if extender_client is not None:
            tls["certFile"], tls["keyFile"] = str(extender_client[0]), str(extender_client[1])
        config["extenders"] = [
            {
                "urlPrefix": extender_url,
                "filterVerb": "filter",
                "prioritizeVerb": "prioritize",
                "bindVerb": "bind",
                "weight": 1,
                "enableHTTPS": True,
                "tlsConfig": tls,
                "nodeCacheCapable": True,
                "httpTimeout": "30s",
                "managedResources": [{"name": r, "ignoredByScheduler": True} for r in managed_resources],
            }
        ]
    return json.dumps(config, indent=2)


def scheduler_argv(binary: Path, config_file: Path, requeue_unschedulable_s: int | None = None) -> list[str]:
    """``requeue_unschedulable_s``: retry pods the extender refused at least this often.

    kube-scheduler requeues a refused pod on cluster events its own plugins care about; a refusal
    by the extender (no vGPU room) names none of them, so without this the pod waits up to 5
    minutes after capacity frees.
    """
    argv = [str(binary), f"--config={config_file}", "--secure-port=0", "--v=1"]
    if requeue_unschedulable_s is not None:
        argv.append(f"--pod-max-in-unschedulable-pods-duration={requeue_unschedulable_s}s")
    return argv


def kwok_argv(binary: Path, layout: Layout, server_port: int) -> list[str]:
    return [
        str(binary),
        f"--kubeconfig={layout.identity_kubeconfig('kwok')}",
        "--manage-all-nodes=false",
        "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
        f"--server-address=127.0.0.1:{server_port}",
        "--node-ip=127.0.0.1",
        "--cidr=10.244.0.1/16",
        f"--config={layout.config / 'kwok.yaml'}",
        "--v=WARN",
    ]
