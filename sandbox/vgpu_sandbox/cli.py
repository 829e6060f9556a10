"""`vgpu sandbox up|status|kubeconfig|down`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from vgpu_sandbox.cluster import Sandbox, Spec, default_dir
from vgpu_sandbox.errors import SandboxError
from vgpu_sandbox.realnode.layout import MONITOR_PORT, NODE_IP


def register(parser: argparse.ArgumentParser) -> None:
    where = f"the sandbox's state folder (default: $VGPU_SANDBOX_DIR or {default_dir()})"
    parser.add_argument("--dir", type=Path, default=None, help=where)
    # also after the action (`vgpu sandbox down --dir X`), where it wins; absent there, it leaves
    # the value before the action alone
    after = argparse.ArgumentParser(add_help=False)
    after.add_argument("--dir", type=Path, default=argparse.SUPPRESS, help=where)
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    def action(name: str, summary: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, parents=[after])

    up = action("up", "start a control plane with simulated GPU nodes")
    defaults = Spec()
    up.add_argument(
        "--nodes", type=int, default=defaults.nodes, help="simulated GPU nodes (default %(default)s)"
    )
    up.add_argument("--gpus-per-node", type=int, default=defaults.gpus_per_node, help="default %(default)s")
    up.add_argument(
        "--gpu-memory", type=int, default=defaults.gpu_memory_mib, help="MiB per GPU (default %(default)s)"
    )
    up.add_argument("--gpu-model", default=defaults.gpu_model, help="model name (default %(default)r)")
    up.add_argument("--split", type=int, default=defaults.split, help="vGPUs per card (default %(default)s)")
    up.add_argument(
        "--mig",
        choices=("single", "mixed", "dynamic"),
        default=None,
        help="the simulated nodes' cards as H100 80GB in MIG mode, offered with this migStrategy "
        "(single: seven 1g.10gb a card as nvidia.com/gpu; mixed: 1g.10gb, 1g.10gb+me, 2g.20gb, 3g.40gb "
        "a card as nvidia.com/mig-<profile>; dynamic: none cut, each vGPU a MIG instance made on "
        "demand; docs/mig.md); with --real-node --dra, dynamic: the stub driver's first card in MIG "
        "mode, offered as MIG slices (`vgpu dra-plugin --mig dynamic`, the DeviceClass "
        "mig.vgpu.openaios.io, examples/dra-mig.yaml)",
    )
    up.add_argument(
        "--apiserver-port", type=int, default=0, help="kube-apiserver's port (default: a free one)"
    )
    up.add_argument(
        "--control-plane-only",
        action="store_true",
        help="run the bare control plane, without the extender and device plugins",
    )
    up.add_argument(
        "--real-node",
        action="store_true",
        help="also run real-node-0: the kubelet, containerd and runc on this machine (root; docs/sandbox.md)",
    )
    up.add_argument(
        "--real-gpu",
        action="store_true",
        help="with --real-node: run the device plugin there on this machine's NVIDIA GPUs (real NVML), "
        "handing containers the driver itself; pair with --nodes 0 (docs/sandbox.md)",
    )
    up.add_argument(
        "--dra",
        action="store_true",
        help="with --real-node: the node in DRA mode, `vgpu dra-plugin` there instead of a device plugin "
        "(on the real cards with --real-gpu, on the stub driver's fake cards without); pods ask "
        "through ResourceClaims of the DeviceClass vgpu.openaios.io (docs/dra.md)",
    )
    up.add_argument(
        "--sharing-mode",
        choices=("timeslice", "mps"),
        default=defaults.sharing,
        help="with --real-node (not --real-gpu nor --dra): how the real node's cards are shared; mps: "
        "the chart's device plugin there runs with sharingMode mps and a fake nvidia-cuda-mps-control "
        "in the node's stub driver root, and only pods annotated nvidia.com/vgpu-mode: mps land "
        "on its cards (docs/mps.md, docs/sandbox.md)",
    )
    up.add_argument(
        "--scheduler-in-cluster",
        action="store_true",
        help="with --real-node: no local extender, kube-scheduler or webhook; the chart's scheduler "
        "Deployment runs them in a pod on the real node once the playbook installs it",
    )
    restart = action("restart", "restart the real node's containerd or kubelet")
    restart.add_argument("component", choices=("containerd", "kubelet"))
    action("status", "what runs, and the nodes").add_argument("--json", action="store_true")
    action("kubeconfig", "print the kubeconfig's path")
    action("down", "stop everything; leaves no process and no listening port")


def _err(message: str) -> int:
    print(f"vgpu sandbox: error: {message}", file=sys.stderr)
    return 1


def run(args: argparse.Namespace) -> int:
    sandbox = Sandbox(args.dir)
    try:
        if args.action == "up":
            spec = Spec(
                nodes=args.nodes,
                gpus_per_node=args.gpus_per_node,
                gpu_memory_mib=args.gpu_memory,
                gpu_model=args.gpu_model,
                split=args.split,
                mig=args.mig or "none",
                sharing=args.sharing_mode,
                apiserver_port=args.apiserver_port,
                product=not args.control_plane_only,
                real_node=args.real_node,
                real_gpu=args.real_gpu,
                dra=args.dra,
                local_scheduler=not args.scheduler_in_cluster,
            )
            seconds = sandbox.up(spec, progress=lambda m: print(f"sandbox: {m}", file=sys.stderr))
            extra = " and the real node real-node-0" if spec.real_node else ""
            print(f"sandbox: up in {seconds:.1f}s with {spec.nodes} nodes{extra}", file=sys.stderr)
            if spec.real_node and not (spec.real_gpu or spec.dra):
                print(
                    f"sandbox: prepare the node and install the chart with: "
                    f"ansible-playbook -i {sandbox.state_dir}/inventory.yml playbooks/site.yml",
                    file=sys.stderr,
                )
            print(f"export KUBECONFIG={sandbox.kubeconfig}")
            return 0
        if args.action == "kubeconfig":
            if not sandbox.kubeconfig.exists():
                return _err(f"no sandbox in {sandbox.state_dir}; start one with `vgpu sandbox up`")
            print(sandbox.kubeconfig)
            return 0
        if args.action == "status":
            report = sandbox.status()
            if args.json:
                print(json.dumps(report, indent=2))
            else:
                _print_status(report)
            # 0 when nothing is wrong: healthy, stopped by `down`, or never started here
            return 0 if report.get("ok") else 1
        if args.action == "restart":
            from vgpu_sandbox.realnode import lifecycle

            seconds = lifecycle.restart(sandbox, args.component)
            print(f"sandbox: {args.component} restarted in {seconds:.1f}s")
            return 0
        if args.action == "down":
            stopped = sandbox.down()
            print(f"sandbox: stopped {len(stopped)} processes" if stopped else "sandbox: nothing was running")
            return 0
    except SandboxError as err:
        return _err(str(err))
    except KeyboardInterrupt:
        return _err("interrupted; everything started was stopped")
    return _err(f"unknown action {args.action!r}")


# what listens on each port the sandbox records in state.json, and how to reach it
_PORTS = {
    "apiserver": ("kube-apiserver", "https://127.0.0.1:{}"),
    "etcd": ("etcd, clients", "http://127.0.0.1:{}"),
    "etcd-peer": ("etcd, peers", "http://127.0.0.1:{}"),
    "kwok": ("KWOK's server (metrics, health)", "http://127.0.0.1:{}/metrics"),
    "extender": ("the extender: filter, bind, webhook", "https://127.0.0.1:{}"),
    "extender-metrics": ("the extender's metrics", "http://127.0.0.1:{}/metrics"),
    "kubelet": ("the real node's kubelet", f"https://{NODE_IP}:{{}}"),
    "kubelet-healthz": ("the real node's kubelet health", "http://127.0.0.1:{}/healthz"),
    MONITOR_PORT: ("the real node's monitor (the chart's)", "http://127.0.0.1:{}/metrics"),
    "real-node-extender": ("the chart's extender, on the real node", f"https://{NODE_IP}:{{}}"),
    "real-node-scheduler-metrics": ("the chart's scheduler metrics", f"http://{NODE_IP}:{{}}/metrics"),
    "real-node-kube-scheduler": ("the chart's kube-scheduler (healthz)", f"https://{NODE_IP}:{{}}/healthz"),
}


def _port_line(name: str, port: int) -> str:
    what, url = _PORTS.get(name, ("", "127.0.0.1:{}"))
    if name.startswith("monitor-"):
        what, url = f"the node monitor of {name[len('monitor-') :]}", "http://127.0.0.1:{}/metrics"
    return f"  {name:<28} {url.format(port):<36} {what}".rstrip()


def _print_status(report: dict[str, object]) -> None:
    state = str(report.get("state", ""))
    if state == "none":
        print(f"no sandbox in {report['dir']}: start one with `vgpu sandbox up`")
        return
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(report.get("started", 0))))  # type: ignore[arg-type]
    if state == "stopped":
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(report.get("stopped", 0))))  # type: ignore[arg-type]
        print(f"sandbox stopped at {at} (vgpu sandbox down), state in {report['dir']}")
        print("start it again with `vgpu sandbox up`")
        return
    print(f"sandbox {state}, started {started}, state in {report['dir']}")
    if state == "starting":
        print("  `vgpu sandbox up` has not finished (or was killed first: `vgpu sandbox down` cleans up)")
    elif state == "degraded":
        print("  a component is DEAD: its log is in logs/; `vgpu sandbox down` then `up` starts anew")
    elif state == "dead":
        print(
            "  every component is gone without `vgpu sandbox down` (a reboot, or killed): `vgpu sandbox up`"
        )
    print(f"kubeconfig: {report.get('kubeconfig')}")
    for comp in report["components"]:  # type: ignore[attr-defined]
        port = f" port {comp['port']}" if comp.get("port") else ""
        print(f"  {comp['name']:<28} pid {comp['pid']:<8} {'running' if comp['alive'] else 'DEAD'}{port}")
    ports = report.get("ports") or {}
    if ports:
        print("ports:")
        for name, port in ports.items():  # type: ignore[attr-defined]
            print(_port_line(name, port))
    if report.get("nodes"):
        print("nodes:")
    for node in report.get("nodes", []):  # type: ignore[attr-defined]
        ready = "Ready" if node["ready"] else "NotReady"
        print(f"  node {node['name']:<23} {ready}  nvidia.com/gpu={node['gpus']}")
    if report.get("nodes_error"):
        print(f"  nodes: cannot list them ({report['nodes_error']})")
