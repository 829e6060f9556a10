"""The handle on one sandbox: its folder, its recorded state, its processes, ports and API server.

``product`` and ``realnode`` start their parts through a :class:`Handle`; ``cluster`` builds the
whole sandbox on it (``Sandbox`` is a ``Handle`` with up, status and down). This module imports
neither, so the three import no one in a circle.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vgpu.commands.status import sandbox_dir
from vgpu.core.errors import KubeError
from vgpu_sandbox import binaries, pki, procs
from vgpu_sandbox.controlplane import Layout
from vgpu_sandbox.errors import SandboxError

if TYPE_CHECKING:
    from vgpu.kube.client import Kube

# Identities and the groups RBAC knows them by. Components get the bootstrap roles
# made for them; only the person's kubeconfig and KWOK are cluster admins.
IDENTITIES: dict[str, tuple[str, str]] = {
    "admin": ("admin", "system:masters"),
    "kube-controller-manager": ("system:kube-controller-manager", ""),
    "kube-scheduler": ("system:kube-scheduler", ""),
    "kwok": ("kwok", "system:masters"),
    "vgpu": ("vgpu", "system:masters"),
    # The real node's kubelet (vgpu sandbox up --real-node), bound to the system:node role.
    "kubelet": ("system:node:real-node-0", "system:nodes"),
}


def default_dir() -> Path:
    return sandbox_dir()


def write_whole(path: Path, text: str) -> None:
    """Write ``path`` through a sibling ``.tmp`` and a rename: a reader sees the old or the new
    text, never a part (the sandbox's records: ``state.json``, the real node's ``node.json``)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


@dataclass
class Spec:
    nodes: int = 3
    gpus_per_node: int = 4
    gpu_memory_mib: int = 81920
    gpu_model: str = "NVIDIA A100-SXM4-80GB"
    split: int = 10
    apiserver_port: int = 0
    product: bool = True
    real_node: bool = False
    # The real node on this machine's NVIDIA GPUs: the device plugin runs there on real NVML,
    # handing containers the driver itself (driverInject: plugin), instead of the chart on fake cards.
    real_gpu: bool = False
    # The real node in DRA mode: ``vgpu dra-plugin`` (vgpu_sandbox.realdra) instead of a device
    # plugin, on the real cards with real_gpu, on the stub driver's fake NVML without.
    dra: bool = False
    # False: no local extender, kube-scheduler nor webhook; the chart's scheduler Deployment runs
    # them in a pod on the real node (needs real_node; realnode/values.py).
    local_scheduler: bool = True
    # MIG ("none": off). On the simulated nodes: their cards as H100 80GB in MIG mode, offered
    # by the device plugin's migStrategy (nodes.MIG_LAYOUTS: single, seven 1g.10gb a card; mixed,
    # 1g.10gb, 1g.10gb+me, 2g.20gb, 3g.40gb; dynamic, none cut: MIG on demand). On the real node,
    # "dynamic" with dra only: the stub driver's first card an H100 80GB in MIG mode, offered as
    # MIG slices (the DRA plugin's ``--mig dynamic``, docs/mig.md#mig-with-dra) instead of shares.
    mig: str = "none"
    # How the real node's cards are shared (docs/mps.md): "timeslice" (the hook's time slices) or
    # "mps": the chart's device plugin there runs with ``sharingMode: mps`` for that node
    # (``nodeOverrides``) and finds a fake ``nvidia-cuda-mps-control`` (vgpu/node/fake_mps.py)
    # in a stub driver root of its own (vgpu_sandbox.realmps).
    sharing: str = "timeslice"

    def validate(self) -> None:
        checks = [
            (self.nodes >= 1 or self.real_node, "--nodes must be at least 1 (0 only with --real-node)"),
            (self.nodes >= 0, "--nodes must not be negative"),
            (self.real_node or not self.real_gpu, "--real-gpu needs --real-node"),
            (self.real_node or not self.dra, "--dra needs --real-node: the DRA plugin serves the real node"),
            (self.local_scheduler or not self.dra, "--dra runs no chart: leave out --scheduler-in-cluster"),
            (self.mig in ("none", "single", "mixed", "dynamic"), "--mig must be single, mixed or dynamic"),
            (
                self.mig in ("none", "dynamic") or not self.real_node,
                "--mig single or mixed is for the simulated nodes: leave out --real-node "
                "(the real node takes --dra --mig dynamic)",
            ),
            (
                self.mig != "dynamic" or not self.real_node or self.dra,
                "--mig dynamic on the real node needs --dra: MIG slices are offered through DRA there",
            ),
            (
                self.mig != "dynamic" or not self.real_gpu,
                "--mig runs on the stub driver's fake card: leave out --real-gpu",
            ),
            (self.sharing in ("timeslice", "mps"), "--sharing-mode must be timeslice or mps"),
            (
                self.sharing == "timeslice" or (self.real_node and not (self.real_gpu or self.dra)),
                "--sharing-mode mps is for the real node on the stub driver with the chart's device "
                "plugin: add --real-node, leave out --real-gpu and --dra",
            ),
            (self.nodes <= 2000, "--nodes must be at most 2000"),
            (1 <= self.gpus_per_node <= 16, "--gpus-per-node must be between 1 and 16"),
            (self.gpu_memory_mib >= 256, "--gpu-memory is in MiB and must be at least 256"),
            (bool(self.gpu_model.strip()), "--gpu-model must not be empty"),
            (1 <= self.split <= 100, "--split must be between 1 and 100"),
            (0 <= self.apiserver_port <= 65535, "--apiserver-port must be between 0 and 65535"),
            (
                self.local_scheduler or self.real_node,
                "--scheduler-in-cluster needs --real-node: the chart's scheduler pod runs there",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise SandboxError(message)


@dataclass
class Component:
    name: str
    pid: int
    argv: list[str]
    port: int | None = None


@dataclass
class State:
    spec: Spec
    ports: dict[str, int] = field(default_factory=dict)
    components: list[Component] = field(default_factory=list)
    started: float = 0.0
    ready: bool = False
    stopped: float = 0.0  # when `vgpu sandbox down` (or a failed `up`) stopped it; 0 while it runs

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> State:
        raw = json.loads(text)
        return cls(
            spec=Spec(**raw["spec"]),
            ports=dict(raw.get("ports", {})),
            components=[Component(**c) for c in raw.get("components", [])],
            started=float(raw.get("started", 0.0)),
            ready=bool(raw.get("ready", False)),
            stopped=float(raw.get("stopped", 0.0)),
        )


class Handle:
    """A handle on the sandbox whose state lives in ``state_dir``: its record, processes, ports
    and API server. :class:`vgpu_sandbox.cluster.Sandbox` adds up, status and down."""

    def __init__(self, state_dir: Path | None = None) -> None:
        self.state_dir = (state_dir or default_dir()).resolve()
        self.layout = Layout(self.state_dir)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._state: State | None = None
        self.ca: pki.CertificateAuthority | None = None
        self._kubes: dict[str, Kube] = {}  # identity -> its client of this run's API server

    # ---- what tests and the CLI use -------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        return self.layout.kubeconfig

    @property
    def logs_dir(self) -> Path:
        return self.layout.logs

    @staticmethod
    def bin(name: str) -> Path:
        return binaries.find(name)

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        argv = [str(self.bin("kubectl")), f"--kubeconfig={self.kubeconfig}", *args]
        result = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise SandboxError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
        return result

    def state(self) -> State | None:
        try:
            return State.from_json(self.layout.state_file.read_text())
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as err:
            raise SandboxError(
                f"{self.layout.state_file} is unreadable ({err}); run `vgpu sandbox down` to clean up"
            ) from err

    def running_pids(self) -> list[int]:
        pids = set(procs.tagged_pids(self.state_dir))
        try:
            state = self.state()
        except SandboxError:
            state = None
        if state is not None:
            pids |= {c.pid for c in state.components if procs.alive(c.pid)}
        return sorted(p for p in pids if procs.alive(p))

    def is_running(self) -> bool:
        return bool(self.running_pids())

    def _save(self) -> None:
        assert self._state is not None
        write_whole(self.layout.state_file, self._state.to_json())

    def port(self, name: str) -> int:
        assert self._state is not None
        if name not in self._state.ports:
            port = procs.free_port()
            while port in self._state.ports.values():
                port = procs.free_port()
            self._state.ports[name] = port
            self._save()
        return self._state.ports[name]

    def adopt(self, state: State) -> None:
        """Take over a running sandbox's recorded state, to start components into it."""
        self._state = state

    def launch(
        self, name: str, argv: Sequence[str], port: int | None = None, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start one component and record it before anything waits on it."""
        assert self._state is not None
        proc = procs.start(name, argv, state_dir=self.state_dir, log_dir=self.layout.logs, env=env)
        self._procs[name] = proc
        self._state.components.append(Component(name=name, pid=proc.pid, argv=list(argv), port=port))
        self._save()
        return proc

    def wait_for(
        self,
        what: str,
        ready: Callable[[], bool],
        timeout: float,
        component: str | Sequence[str] | None = None,
    ) -> None:
        """Poll ``ready`` until it holds; fail at once, with its log, if a watched component exits."""
        watched = [component] if isinstance(component, str) else list(component or [])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name in watched:
                proc = self._procs.get(name)
                if proc is not None and proc.poll() is not None:
                    raise SandboxError(
                        f"{name} exited with code {proc.returncode} while starting; "
                        f"its log is {self.layout.logs / (name + '.log')}{self._log_tail(name)}"
                    )
            try:
                if ready():
                    return
            except (OSError, KubeError, SandboxError, subprocess.SubprocessError):
                pass
            time.sleep(0.2)
        logs = ", ".join(str(self.layout.logs / f"{name}.log") for name in watched[:3])
        hint = f"; see {logs}" if watched else ""
        raise SandboxError(f"timed out after {timeout:.0f}s waiting for {what}{hint}")

    def _log_tail(self, component: str, lines: int = 8) -> str:
        try:
            text = (self.layout.logs / f"{component}.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n  " + "\n  ".join(text[-lines:]) if text else ""

    def kube(self, identity: str = "admin") -> Kube:
        """A client of the API server as ``identity`` (from its kubeconfig), kept for this run."""
        client = self._kubes.get(identity)
        if client is None:
            from vgpu.kube.client import Kube  # the kubernetes package, only once a command needs it

            path = (
                self.layout.kubeconfig if identity == "admin" else self.layout.identity_kubeconfig(identity)
            )
            client = self._kubes[identity] = Kube(str(path), pool_size=4)
        return client

    def forget_clients(self) -> None:
        """Close the clients: the API server they know is going (its port may change)."""
        kubes, self._kubes = self._kubes, {}
        for client in kubes.values():
            client.close()

    def api_get(self, path: str, identity: str = "admin") -> Any:
        """GET an API path as ``identity`` (the CA verified): its JSON, or its text (``/readyz``).

        Errors (a refused connection, an HTTP error such as 404) raise KubeError.
        """
        return self.kube(identity).get(path)

    def _tokens(self) -> dict[str, str]:
        tokens = {}
        for line in (self.layout.config / "tokens.csv").read_text().splitlines():
            token, user, *_ = line.split(",")
            for identity, (name, _group) in IDENTITIES.items():
                if name == user:
                    tokens[identity] = token
        return tokens
