"""``vgpu extender``: the kube-scheduler extender and admission webhook over HTTPS.

    vgpu extender --kubeconfig PATH --listen HOST:PORT --cert-file PEM --key-file PEM
                  [--client-ca-file PEM]
                  --metrics-listen HOST:PORT --namespace NS --scheduler-name vgpu-scheduler
                  [--workers N] [--node-policy binpack|spread] [--gpu-policy binpack|spread]
                  [--default-mem MIB] [--default-cores PCT] [--filter-keep N]
                  [--reject-unsatisfiable true|false] [--config FILE]

Without --kubeconfig: the in-cluster service account. Settings: flag > ``VGPU_*`` environment >
--config file > defaults (see vgpu.core.config). ``--workers`` is the number of threads of the single
worker process that holds the ledger (see vgpu.extender.server for why not processes).
``--filter-keep`` (or ``VGPU_FILTER_KEEP``): how many of the feasible nodes ``filter`` answers for a
vGPU pod, the best by the pod's node policy (default 1: kube-scheduler then binds there without
scoring; see docs/scheduling.md). ``--reject-unsatisfiable true`` (or
``VGPU_REJECT_UNSATISFIABLE``): the validating webhook also denies a request larger than any card
or node the cluster has now; by default such a pod is admitted and waits Pending (a cluster
autoscaler may add the node it needs).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping

from vgpu.core import logs
from vgpu.core.config import POLICIES, load_config
from vgpu.core.errors import ConfigError


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster service account)")
    parser.add_argument("--listen", help="HOST:PORT for the HTTPS verbs and webhook (default 0.0.0.0:9443)")
    parser.add_argument("--cert-file", help="PEM certificate for HTTPS")
    parser.add_argument("--key-file", help="PEM private key for HTTPS")
    parser.add_argument(
        "--client-ca-file",
        help="PEM CA: filter, prioritize and bind answer only a caller with a client certificate it "
        "signed (kube-scheduler's extender tlsConfig certFile/keyFile); the webhooks need none",
    )
    parser.add_argument("--metrics-listen", help="HOST:PORT for plain-HTTP /metrics (default 0.0.0.0:9395)")
    parser.add_argument("--namespace", help="namespace of the Leases (default kube-system)")
    parser.add_argument("--scheduler-name", help="schedulerName pods are routed to (default vgpu-scheduler)")
    parser.add_argument("--workers", type=int, help="threads answering calls (default 32)")
    parser.add_argument("--node-policy", choices=POLICIES, help="cluster default (default binpack)")
    parser.add_argument("--gpu-policy", choices=POLICIES, help="cluster default (default spread)")
    parser.add_argument(
        "--default-mem", type=int, help="MiB per vGPU when only nvidia.com/gpu is given (0 = card)"
    )
    parser.add_argument(
        "--default-cores", type=int, help="percent of a card per vGPU when not given (0 = no cap)"
    )
    parser.add_argument(
        "--filter-keep",
        type=int,
        help="feasible nodes filter answers for a vGPU pod, the best by its node policy (default 1)",
    )
    parser.add_argument(
        "--reject-unsatisfiable",
        metavar="true|false",
        help="the webhook also denies requests larger than any card or node the cluster has now "
        "(default false: such pods wait Pending, e.g. for a cluster autoscaler)",
    )
    parser.add_argument(
        "--scheduler-account",
        help="user name of the scheduler's ServiceAccount (kube-scheduler and this extender): the webhook "
        "lets only it, and --node-agent-account on its own node, write the placement annotations "
        "(default: none, placements unchecked by the webhook; docs/security.md)",
    )
    parser.add_argument(
        "--node-agent-account",
        help="user name of the device plugin's ServiceAccount (see --scheduler-account)",
    )
    parser.add_argument(
        "--high-priority-namespaces",
        metavar="NS[,NS...]",
        help="namespaces whose pods and claims may ask for priority 0 (default: none)",
    )
    parser.add_argument("--identity", help="holder name for the Lease (default: host name)")
    parser.add_argument("--config", help="YAML/JSON settings file (keys: defaultMem, nodePolicy, ...)")
    parser.add_argument("--insecure-http", action="store_true", help="serve plain HTTP (tests only)")


FLAGS = (
    "kubeconfig",
    "listen",
    "cert_file",
    "key_file",
    "client_ca_file",
    "metrics_listen",
    "namespace",
    "scheduler_name",
    "workers",
    "node_policy",
    "gpu_policy",
    "default_mem",
    "default_cores",
    "identity",
    "reject_unsatisfiable",
    "scheduler_account",
    "node_agent_account",
    "high_priority_namespaces",
)


def filter_keep_setting(flag: int | None, env: Mapping[str, str]) -> int:
    """--filter-keep, else VGPU_FILTER_KEEP, else the default; at least 1."""
    from vgpu.extender.state import FILTER_KEEP

    if flag is not None:
        source, value = "flag", str(flag)
    elif env.get("VGPU_FILTER_KEEP"):
        source, value = "environment", env["VGPU_FILTER_KEEP"]
    else:
        return FILTER_KEEP
    name = "--filter-keep" if source == "flag" else "VGPU_FILTER_KEEP"
    try:
        keep = int(value.strip())
    except ValueError:
        raise ConfigError(source, name, f"must be an integer of at least 1, got {value!r}") from None
    if keep < 1:
        raise ConfigError(source, name, f"must be at least 1 (the best node), got {keep}")
    return keep


def run(args: argparse.Namespace) -> int:
    logs.configure("INFO")
    try:
        config = load_config({k: getattr(args, k) for k in FLAGS}, file=args.config)
        filter_keep = filter_keep_setting(getattr(args, "filter_keep", None), os.environ)
    except ConfigError as err:
        print(f"vgpu extender: {err}", file=sys.stderr)
        return 2
    proc = config.process
    if not args.insecure_http and not (proc.cert_file and proc.key_file):
        print(
            "vgpu extender: --cert-file and --key-file are required: kube-scheduler calls the extender over "
            "HTTPS with a verified CA (use --insecure-http only in tests)",
            file=sys.stderr,
        )
        return 2
    if proc.client_ca_file and args.insecure_http:
        print(
            "vgpu extender: --client-ca-file needs HTTPS (client certificates are TLS's): drop "
            "--insecure-http, or the client CA",
            file=sys.stderr,
        )
        return 2
    files = (
        ("--cert-file", proc.cert_file),
        ("--key-file", proc.key_file),
        ("--client-ca-file", proc.client_ca_file),
    )
    for flag, path in files:
        if path and not os.path.isfile(path):
            print(f"vgpu extender: {flag} {path}: no such file", file=sys.stderr)
            return 2
    # multiprocess metrics: the directory must be known before prometheus_client makes a metric
    own_dir = not os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if own_dir:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="vgpu-extender-metrics-")
    try:
        from vgpu.extender import server

        return server.run(config, filter_keep)
    finally:
        if own_dir:
            shutil.rmtree(os.environ["PROMETHEUS_MULTIPROC_DIR"], ignore_errors=True)
