"""roles/gpu_node applied to a real Debian host: a debootstrap folder reached through Ansible's
chroot connection, with no route to NVIDIA (its apt sources are emptied, as on an air-gapped
node). A local apt repository served over HTTP on 127.0.0.1 stands in for NVIDIA's repository
(or a site's mirror of it); it carries a small nvidia-container-toolkit package built here with
dpkg-deb. Stand-ins for what a chroot cannot have: a fake `nvidia-smi` (the driver) and a
`systemctl` that records what it is asked (the init system).

The debootstrap folder is built once (about a minute) and cached outside the repository in
``$XDG_CACHE_HOME/vgpu/debootstrap`` (default ``~/.cache/vgpu/debootstrap``); every test works
on its own copy.
"""

from __future__ import annotations

import fcntl
import hashlib
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
SUITE = "bookworm"
MIRROR = os.environ.get("VGPU_DEBIAN_MIRROR", "http://deb.debian.org/debian")
INCLUDE = "python3,python3-apt"
TOOLKIT_VERSION = "1.17.8-1"

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="a chroot test host needs root (chroot, debootstrap)"),
    pytest.mark.timeout(600),
    pytest.mark.xdist_spread,  # each test plays on a copy of its own: workers share none (tests/README.md)
]

FAKE_NVIDIA_SMI = """#!/bin/sh
# Stands in for the NVIDIA driver: answers the role's query like nvidia-smi on a 2-GPU host.
echo "550.54.15, NVIDIA A100-SXM4-80GB"
echo "550.54.15, NVIDIA A100-SXM4-80GB"
"""

RECORDING_SYSTEMCTL = """#!/bin/sh
# Stands in for systemd (a chroot has no init system): records every call, and reports every
# unit as loaded and running, as systemctl show does.
echo "$*" >> /var/log/systemctl-calls.log
case "$1" in
  show) printf 'Id=%s.service\\nLoadState=loaded\\nActiveState=active\\nSubState=running\\n' "$2"
        printf 'UnitFileState=enabled\\n' ;;
  is-enabled) echo enabled ;;
  is-active) echo active ;;
esac
exit 0
"""

# The package's nvidia-ctk does, for containerd, what NVIDIA's does: adds the nvidia runtime to
# config.toml (and makes it the default) unless it is already there, keeping everything else.
FAKE_NVIDIA_CTK = """#!/bin/sh
set -e
if [ "$1" = config ]; then
  # config --in-place --config-file=F --set key=value...: each key one "key = value" line, replaced
  shift
  file=/etc/nvidia-container-runtime/config.toml
  for arg in "$@"; do case "$arg" in --config-file=*) file="${arg#--config-file=}" ;; esac; done
  mkdir -p "$(dirname "$file")"
  touch "$file"
  prev=
  for arg in "$@"; do
    if [ "$prev" = --set ]; then
      key="${arg%%=*}"
      grep -v "^$key = " "$file" > "$file.new" || true
      echo "$key = ${arg#*=}" >> "$file.new"
      mv "$file.new" "$file"
    fi
    prev="$arg"
  done
  exit 0
fi
[ "$1 $2" = "runtime configure" ] || { echo "nvidia-ctk (test package): unsupported: $*" >&2; exit 2; }
config=/etc/containerd/config.toml default=no runtime=docker
for arg in "$@"; do
  case "$arg" in
    --config=*) config="${arg#--config=}" ;;
    --runtime=*) runtime="${arg#--runtime=}" ;;
    --set-as-default) default=yes ;;
  esac
done
[ "$runtime" = containerd ] || { echo "nvidia-ctk (test package): only containerd" >&2; exit 2; }
mkdir -p "$(dirname "$config")"
touch "$config"
grep -q 'runtimes.nvidia]' "$config" && exit 0
{
  echo
  echo '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]'
  echo '  runtime_type = "io.containerd.runc.v2"'
  echo '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]'
  echo '  BinaryName = "/usr/bin/nvidia-container-runtime"'
  if [ "$default" = yes ]; then
    echo '[plugins."io.containerd.grpc.v1.cri".containerd]'
    echo '  default_runtime_name = "nvidia"'
  fi
} >> "$config"
echo "INFO Wrote updated config to $config"
"""

FAKE_RUNTIME = """#!/bin/sh
echo "nvidia-container-runtime (test package) $*"
"""


# ---- the cached Debian folder -------------------------------------------------------------
def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vgpu" / "debootstrap"


def _debootstrap() -> str:
    found = shutil.which("debootstrap") or (
        Path("/usr/sbin/debootstrap").exists() and "/usr/sbin/debootstrap"
    )
    if found:
        return str(found)
    if shutil.which("apt-get") is None:
        pytest.skip("debootstrap is missing and there is no apt-get to install it")
    install = ["apt-get", "install", "-y", "-q", "debootstrap"]
    if subprocess.run(install, capture_output=True, timeout=300).returncode != 0:  # stale package lists
        subprocess.run(["apt-get", "update", "-q"], check=True, capture_output=True, timeout=300)
        subprocess.run(install, check=True, capture_output=True, timeout=300)
    return shutil.which("debootstrap") or "/usr/sbin/debootstrap"


def _base_root() -> Path:
    """A minimal Debian with python3 and python3-apt (what Ansible's apt module needs)."""
    tag = hashlib.sha256(f"{SUITE} {MIRROR} {INCLUDE}".encode()).hexdigest()[:8]
    target = _cache_dir() / f"{SUITE}-minbase-{tag}"
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # pytest-xdist workers (make test) each ask for it: one builds, the others wait and then use it
    with (target.parent / f".{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / ".complete").exists():
            return target
        return _build_root(target)


def _build_root(target: Path) -> Path:
    work = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    result = subprocess.run(
        [_debootstrap(), "--variant=minbase", f"--include={INCLUDE}", SUITE, str(work), MIRROR],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if result.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        raise RuntimeError(f"debootstrap failed: {result.stdout[-2000:]}{result.stderr[-2000:]}")
    (work / ".complete").touch()
    shutil.rmtree(target, ignore_errors=True)
    work.rename(target)
    return target


@pytest.fixture(scope="session")
def debian_root() -> Path:
    return _base_root()


# ---- the local package source ---------------------------------------------------------------
def _deb_arch() -> str:
    return subprocess.run(
        ["dpkg", "--print-architecture"], capture_output=True, text=True, check=True
    ).stdout.strip()


def _build_repo(repo: Path) -> None:
    """A flat apt repository (like NVIDIA's: `deb URL /`) holding nvidia-container-toolkit."""
    arch = _deb_arch()
    pkg = repo.parent / "pkg"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "usr" / "bin").mkdir(parents=True)
    for name, text in (("nvidia-ctk", FAKE_NVIDIA_CTK), ("nvidia-container-runtime", FAKE_RUNTIME)):
        path = pkg / "usr" / "bin" / name
        path.write_text(text)
        path.chmod(0o755)
    (pkg / "DEBIAN" / "control").write_text(
        f"Package: nvidia-container-toolkit\nVersion: {TOOLKIT_VERSION}\nArchitecture: {arch}\n"
        "Maintainer: vgpu tests <tests@vgpu.invalid>\nSection: utils\nPriority: optional\n"
        "Description: test stand-in for NVIDIA's container toolkit\n"
        " nvidia-ctk and nvidia-container-runtime stubs.\n"
    )
    repo.mkdir(parents=True)
    deb = repo / f"nvidia-container-toolkit_{TOOLKIT_VERSION}_{arch}.deb"
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "--build", str(pkg), str(deb)], check=True, capture_output=True
    )
    control = subprocess.run(
        ["dpkg-deb", "--field", str(deb)], check=True, capture_output=True, text=True
    ).stdout
    data = deb.read_bytes()
    stanza = (
        control.rstrip("\n")
        + f"\nFilename: ./{deb.name}\nSize: {len(data)}\nMD5sum: {hashlib.md5(data).hexdigest()}\n"
        + f"SHA256: {hashlib.sha256(data).hexdigest()}\n\n"
    )
    (repo / "Packages").write_text(stanza)
    packages = (repo / "Packages").read_bytes()
    (repo / "Release").write_text(
        "Origin: vgpu tests\nLabel: nvidia-container-toolkit mirror\nArchitectures: " + arch + "\n"
        f"SHA256:\n {hashlib.sha256(packages).hexdigest()} {len(packages)} Packages\n"
    )


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        return None


@pytest.fixture(scope="module")
def package_source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The repository, served over HTTP on 127.0.0.1 (the chroot shares the network)."""
    repo = tmp_path_factory.mktemp("nvidia-mirror") / "repo"
    _build_repo(repo)

    def handler(*args: object, **kwargs: object) -> _QuietHandler:
        return _QuietHandler(*args, directory=str(repo), **kwargs)  # type: ignore[arg-type]

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)  # type: ignore[arg-type]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- one test host --------------------------------------------------------------------------
@dataclass
class Host:
    root: Path
    inventory: Path

    def file(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def write(self, path: str, text: str, mode: int = 0o644) -> None:
        target = self.file(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        target.chmod(mode)

    def systemctl_calls(self) -> list[str]:
        log = self.file("/var/log/systemctl-calls.log")
        return log.read_text().splitlines() if log.exists() else []

    def snapshot(self) -> dict[str, str]:
        """What a failed play must leave as it was: /etc, the package database, the programs."""
        seen: dict[str, str] = {}
        for top in ("etc", "usr/bin", "var/lib/dpkg/status"):
            base = self.root / top
            paths = [base] if base.is_file() else sorted(base.rglob("*"))
            for path in paths:
                rel = str(path.relative_to(self.root))
                if path.is_symlink():
                    seen[rel] = "link:" + os.readlink(path)
                elif path.is_file():
                    seen[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
                elif path.is_dir():
                    seen[rel] = "dir"
        return seen

    def play(
        self, playbook: str = "playbooks/gpu_nodes.yml", *extra: str
    ) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0", ANSIBLE_RETRY_FILES_ENABLED="0")
        env.pop("KUBECONFIG", None)
        return subprocess.run(
            [str(ANSIBLE_PLAYBOOK), "-i", str(self.inventory), str(ROOT / playbook), *extra],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=480,
        )


def _recap(result: subprocess.CompletedProcess[str]) -> dict[str, int]:
    match = re.search(r"^test-node\s+:\s+(.*)$", result.stdout, re.M)
    assert match, f"no play recap for test-node:\n{result.stdout[-3000:]}\n{result.stderr[-2000:]}"
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", match.group(1))}


def _make_host(
    tmp_path: Path, debian_root: Path, source: str, driver: bool = True, **role_vars: object
) -> Host:
    root = tmp_path / "host"
    subprocess.run(["cp", "-a", str(debian_root), str(root)], check=True)
    # An air-gapped node: no Debian mirror, only the package source the role is given.
    (root / "etc/apt/sources.list").write_text("")
    host = Host(root=root, inventory=tmp_path / "inventory.yml")
    host.write("/usr/bin/systemctl", RECORDING_SYSTEMCTL, 0o755)
    if driver:
        host.write("/usr/bin/nvidia-smi", FAKE_NVIDIA_SMI, 0o755)
    host_vars = {
        "ansible_connection": "community.general.chroot",
        "ansible_host": str(root),
        "ansible_python_interpreter": "/usr/bin/python3",
        "ansible_become": False,
        "gpu_node_apt_repo_url": source,
        "gpu_node_apt_key_url": "",
        "gpu_node_package_source_timeout": 5,
        "gpu_node_kubernetes_label": False,
        **role_vars,
    }
    host.inventory.write_text(json.dumps({"gpu_nodes": {"hosts": {"test-node": host_vars}}}))
    return host


CONTAINERD_CONFIG = """version = 2
[plugins."io.containerd.grpc.v1.cri".registry]
  config_path = "/etc/containerd/certs.d"
"""

HOST_DAEMON_JSON = {
    "registry-mirrors": ["https://mirror.internal.example:5000"],
    "log-driver": "journald",
    "data-root": "/srv/docker",
    "runtimes": {"runsc": {"path": "/usr/local/bin/runsc"}},
}


# ---- the tests ------------------------------------------------------------------------------
def test_gpu_node_merges_the_nvidia_runtime_into_the_hosts_daemon_json_and_a_second_run_changes_nothing(
    tmp_path: Path, debian_root: Path, package_source: str
) -> None:
    host = _make_host(tmp_path, debian_root, package_source)
    host.write("/etc/docker/daemon.json", json.dumps(HOST_DAEMON_JSON, indent=4))

    first = host.play()
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
    assert _recap(first)["changed"] > 0

    merged = json.loads(host.file("/etc/docker/daemon.json").read_text())
    for key, value in HOST_DAEMON_JSON.items():
        if key != "runtimes":
            assert merged[key] == value, f"the host's {key} was not kept"
    assert merged["runtimes"]["runsc"] == {"path": "/usr/local/bin/runsc"}
    assert merged["runtimes"]["nvidia"] == {"path": "/usr/bin/nvidia-container-runtime", "args": []}
    assert merged["default-runtime"] == "nvidia"
    # the tenant boundary: an unprivileged container's NVIDIA_VISIBLE_DEVICES gets it no card
    toolkit = host.file("/etc/nvidia-container-runtime/config.toml").read_text().splitlines()
    assert "accept-nvidia-visible-devices-envvar-when-unprivileged = false" in toolkit
    assert "accept-nvidia-visible-devices-as-volume-mounts = true" in toolkit
    assert host.file("/usr/bin/nvidia-ctk").exists(), "nvidia-container-toolkit was not installed"
    status = host.file("/var/lib/dpkg/status").read_text()
    assert "Package: nvidia-container-toolkit\nStatus: install ok installed" in status
    assert (
        host.file("/etc/apt/sources.list.d/nvidia-container-toolkit.list").read_text().count(package_source)
        == 1
    )
    assert host.systemctl_calls().count("restart docker") == 1, host.systemctl_calls()
    rendered = host.file("/etc/docker/daemon.json").read_bytes()

    second = host.play()
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-2000:]
    assert _recap(second)["changed"] == 0, second.stdout[-4000:]
    assert host.file("/etc/docker/daemon.json").read_bytes() == rendered
    assert host.systemctl_calls().count("restart docker") == 1, "Docker restarted without a config change"


def test_gpu_node_writes_daemon_json_when_the_host_has_none_and_merges_inventory_options_over_it(
    tmp_path: Path, debian_root: Path, package_source: str
) -> None:
    host = _make_host(
        tmp_path,
        debian_root,
        package_source,
        gpu_node_docker_daemon_options={"log-opts": {"max-size": "100m"}, "default-runtime": "runc"},
    )
    result = host.play()
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    written = json.loads(host.file("/etc/docker/daemon.json").read_text())
    assert written == {
        "default-runtime": "runc",
        "log-opts": {"max-size": "100m"},
        "runtimes": {"nvidia": {"args": [], "path": "/usr/bin/nvidia-container-runtime"}},
    }


def test_gpu_node_configures_containerd_instead_and_restarts_it_only_when_its_config_changed(
    tmp_path: Path, debian_root: Path, package_source: str
) -> None:
    # a site's own toolkit settings are merged in; the tenant boundary's two cannot be turned back
    settings = {
        "nvidia-container-runtime.mode": "cdi",
        "accept-nvidia-visible-devices-envvar-when-unprivileged": True,
    }
    host = _make_host(
        tmp_path,
        debian_root,
        package_source,
        gpu_node_container_runtime="containerd",
        gpu_node_nvidia_runtime_settings=settings,
    )
    original = CONTAINERD_CONFIG
    host.write("/etc/containerd/config.toml", original)

    first = host.play()
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
    toolkit = host.file("/etc/nvidia-container-runtime/config.toml").read_text().splitlines()
    assert "nvidia-container-runtime.mode = cdi" in toolkit
    assert "accept-nvidia-visible-devices-envvar-when-unprivileged = false" in toolkit
    config = host.file("/etc/containerd/config.toml").read_text()
    assert config.startswith(original), "containerd's own settings were not kept"
    assert 'default_runtime_name = "nvidia"' in config
    assert host.file("/etc/containerd/config.toml.before-nvidia").read_text() == original
    assert not host.file("/etc/docker/daemon.json").exists()
    assert host.systemctl_calls().count("restart containerd") == 1, host.systemctl_calls()

    second = host.play()
    assert second.returncode == 0, second.stdout[-4000:]
    assert _recap(second)["changed"] == 0, second.stdout[-4000:]
    assert host.systemctl_calls().count("restart containerd") == 1


def test_a_missing_driver_stops_the_play_with_the_fix_and_leaves_the_host_as_it_was(
    tmp_path: Path, debian_root: Path, package_source: str
) -> None:
    host = _make_host(tmp_path, debian_root, package_source, driver=False)
    host.write("/etc/docker/daemon.json", json.dumps(HOST_DAEMON_JSON))
    before = host.snapshot()

    result = host.play()
    assert result.returncode != 0
    assert "The NVIDIA driver is not working on test-node" in result.stdout
    assert "Fix: install the NVIDIA driver" in result.stdout
    assert host.snapshot() == before
    assert host.systemctl_calls() == []


def test_an_unreachable_package_source_stops_the_play_with_the_fix_and_leaves_the_host_as_it_was(
    tmp_path: Path, debian_root: Path
) -> None:
    dead = f"http://127.0.0.1:{_closed_port()}/nvidia"
    host = _make_host(tmp_path, debian_root, dead)
    host.write("/etc/docker/daemon.json", json.dumps(HOST_DAEMON_JSON))
    before = host.snapshot()

    result = host.play()
    assert result.returncode != 0
    assert f"The package source {dead} cannot be reached from test-node" in result.stdout
    assert "Fix: set gpu_node_apt_repo_url" in result.stdout
    assert host.snapshot() == before


def test_a_malformed_daemon_json_stops_the_play_with_the_fix_and_leaves_the_host_as_it_was(
    tmp_path: Path, debian_root: Path, package_source: str
) -> None:
    host = _make_host(tmp_path, debian_root, package_source)
    host.write("/etc/docker/daemon.json", '{"registry-mirrors": ["https://mirror.internal"],\n')
    before = host.snapshot()

    result = host.play()
    assert result.returncode != 0
    assert "/etc/docker/daemon.json on test-node is not a JSON object" in result.stdout
    assert "Fix: correct the file" in result.stdout
    assert host.snapshot() == before
    assert host.systemctl_calls() == []


def test_a_daemon_json_holding_a_list_is_refused_like_malformed_json(
    tmp_path: Path, debian_root: Path, package_source: str
) -> None:
    host = _make_host(tmp_path, debian_root, package_source)
    host.write("/etc/docker/daemon.json", '["not", "an", "object"]')
    before = host.snapshot()

    result = host.play()
    assert result.returncode != 0
    assert "is not a JSON object" in result.stdout
    assert host.snapshot() == before


def test_check_mode_on_a_fresh_host_shows_the_daemon_json_diff_and_changes_nothing(
    tmp_path: Path, debian_root: Path, package_source: str
) -> None:
    host = _make_host(tmp_path, debian_root, package_source)
    host.write("/etc/docker/daemon.json", json.dumps(HOST_DAEMON_JSON))
    before = host.snapshot()

    result = host.play("playbooks/gpu_nodes.yml", "--check", "--diff")
    assert result.returncode == 0, result.stdout[-4000:]
    assert _recap(result)["changed"] > 0
    assert '+  "default-runtime": "nvidia",' in result.stdout, result.stdout[-6000:]
    assert host.snapshot() == before
    assert [c for c in host.systemctl_calls() if not c.startswith("show ")] == [], (
        "check mode restarted Docker"
    )


def test_a_driver_older_than_required_stops_the_play_and_leaves_the_host_as_it_was(
    tmp_path: Path, debian_root: Path, package_source: str
) -> None:
    host = _make_host(tmp_path, debian_root, package_source, gpu_node_driver_min_version="560.28")
    before = host.snapshot()

    result = host.play()
    assert result.returncode != 0
    assert (
        "The NVIDIA driver on test-node is 550.54.15, older than gpu_node_driver_min_version=560.28"
        in result.stdout
    )
    assert host.snapshot() == before
