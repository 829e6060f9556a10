"""One home per contract (docs/contracts.md, issue 38): each contract's literal (a name, a path, a
key) is written in exactly one product module, its owner, and every other module imports it from
there. A second copy is how the two drift apart: the DRA driver's name once had three homes, the
claim record's path two (the plugin writing it, the monitor reading it).

The scan reads every module of the product (``vgpu/``) and of the sandbox (``sandbox/vgpu_sandbox``)
with ``ast``: a string constant outside a docstring (an f-string's fixed parts too) that holds a
contract's literal, bounded as a name is (``vgpu.openaios.io`` in ``/var/lib/kubelet/plugins/
vgpu.openaios.io`` or ``vgpu.openaios.io-reg.sock``, but not in ``vgpu.openaios.io/devices`` nor
``mps.vgpu.openaios.io``, which are literals of their own), counts as a home. The chart and the
docs are held to the owner's value."""

from __future__ import annotations

import ast
import importlib
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = (ROOT / "vgpu", ROOT / "sandbox" / "vgpu_sandbox")
GENERATED = ("vgpu/deviceplugin/api/", "vgpu/dra/api/")
CHART = ROOT / "charts" / "vgpu"
CONTRACTS_DOC = ROOT / "docs" / "contracts.md"


@dataclass(frozen=True)
class Home:
    literal: str
    owner: str  # module
    name: str  # the owner's attribute holding it (dotted: a class's default)
    contract: int  # docs/contracts.md's number
    prefix: bool = False  # a prefix of longer names (``nvidia.com/mig-``): matched without its end bounded
    path: bool = False  # a folder under a root given at run time: also found as ``root / "a" / "b"``


# literal -> its owner. A new contract literal joins this table with its owner.
HOMES = (
    # contract 8 (and 6: the kubelet's folders are named after it; the CDI vendor is it)
    Home("vgpu.openaios.io", "vgpu.core.claimconfig", "DRIVER", 8),
    Home("vgpu.openaios.io/v1", "vgpu.core.claimconfig", "API_VERSION", 8),
    Home("VgpuConfig", "vgpu.core.claimconfig", "KIND", 8),
    Home("mps.vgpu.openaios.io", "vgpu.core.claimconfig", "MPS_CLASS", 8),
    Home("mig.vgpu.openaios.io", "vgpu.dra.migslices", "MIG_CLASS", 8),
    Home("openaios.io/gpu-mode", "vgpu.core.gpumode", "GPU_MODE_LABEL", 8),
    # contract 1: resources and the pod annotations a user writes
    Home("nvidia.com/gpu", "vgpu.core.annotations", "GPU_RESOURCE", 1),
    Home("nvidia.com/gpumem", "vgpu.core.requests", "RESOURCE_MEM", 1),
    Home("nvidia.com/gpumem-percentage", "vgpu.core.requests", "RESOURCE_MEM_PERCENT", 1),
    Home("nvidia.com/gpucores", "vgpu.core.requests", "RESOURCE_CORES", 1),
    Home("nvidia.com/priority", "vgpu.core.requests", "RESOURCE_PRIORITY", 1),
    Home("nvidia.com/mig-", "vgpu.core.mig", "RESOURCE_PREFIX", 1, prefix=True),
    Home("nvidia.com/use-gputype", "vgpu.core.annotations", "USE_GPUTYPE_ANNOTATION", 1),
    Home("nvidia.com/nouse-gputype", "vgpu.core.annotations", "NOUSE_GPUTYPE_ANNOTATION", 1),
    Home("nvidia.com/use-gpuuuid", "vgpu.core.annotations", "USE_GPUUUID_ANNOTATION", 1),
    Home("nvidia.com/nouse-gpuuuid", "vgpu.core.annotations", "NOUSE_GPUUUID_ANNOTATION", 1),
    Home("nvidia.com/vgpu-mode", "vgpu.core.annotations", "HAMI_VGPU_MODE_ANNOTATION", 1),
    Home("nvidia.com/numa-bind", "vgpu.core.annotations", "HAMI_NUMA_BIND_ANNOTATION", 1),
    Home("hami.io/node-scheduler-policy", "vgpu.core.annotations", "HAMI_NODE_POLICY_ANNOTATION", 1),
    Home("hami.io/gpu-scheduler-policy", "vgpu.core.annotations", "HAMI_GPU_POLICY_ANNOTATION", 1),
    Home("vgpu.openaios.io/node-policy", "vgpu.core.annotations", "NODE_POLICY_ANNOTATION", 1),
    Home("vgpu.openaios.io/gpu-policy", "vgpu.core.annotations", "GPU_POLICY_ANNOTATION", 1),
    # contract 2: the node inventory and the Lease's annotations
    Home("vgpu.openaios.io/devices", "vgpu.core.annotations", "DEVICES_ANNOTATION", 2),
    Home("vgpu.openaios.io/usage", "vgpu.core.annotations", "USAGE_ANNOTATION", 2),
    Home("vgpu.openaios.io/memory-lines", "vgpu.core.annotations", "LINES_ANNOTATION", 2),
    Home("vgpu.openaios.io/codec", "vgpu.core.annotations", "CODEC_ANNOTATION", 2),
    # contract 3: the placement
    Home("vgpu.openaios.io/allocation", "vgpu.core.annotations", "ALLOCATION_ANNOTATION", 3),
    Home("vgpu.openaios.io/phase", "vgpu.core.annotations", "PHASE_ANNOTATION", 3),
    Home("vgpu.openaios.io/reason", "vgpu.core.annotations", "REASON_ANNOTATION", 3),
    Home("vgpu.openaios.io/room-freed", "vgpu.core.annotations", "ROOM_FREED_ANNOTATION", 3),
    # contract 6: the extender's endpoints, the DRA plugin's kubelet folders and sockets
    Home("0.0.0.0:9443", "vgpu.core.config", "SchedulerConfig.listen", 6),
    Home("0.0.0.0:9395", "vgpu.core.config", "SchedulerConfig.metrics_listen", 6),
    Home("/var/lib/kubelet/plugins_registry", "vgpu.dra.server", "REGISTRY_DIR", 6),
    Home("dra.sock", "vgpu.dra.server", "DRA_SOCKET_NAME", 6),
    # contract 6: the node monitor's /metrics, whether the device plugin or `vgpu monitor` serves it
    Home("0.0.0.0:9394", "vgpu.node.flags", "DEFAULT_MONITOR_LISTEN", 6),
    # contract 2: the Lease's holder identity
    Home("vgpu-device-plugin/", "vgpu.core.annotations", "LEASE_HOLDER_PREFIX", 2, prefix=True),
    # contract 7: where the claim records live
    Home("dra/claims", "vgpu.core.drarecord", "CLAIMS_SUBDIR", 7, path=True),
    # the sandbox's own record of what its kubelet stand-in admitted (read by `vgpu status`)
    Home("sandbox.vgpu.openaios.io/containers", "vgpu.commands.status", "RECORD_ANNOTATION", 0),
)

# Copies that are another thing of the same spelling, each with why.
NOT_A_COPY = {
    # NVIDIA's taint on GPU nodes and NVIDIA's CDI kind: their names, which happen to be the resource's
    ("sandbox/vgpu_sandbox/realnode/layout.py", "nvidia.com/gpu"): "the taint key NVIDIA's GPU nodes carry",
    ("sandbox/vgpu_sandbox/realruntime.py", "nvidia.com/gpu"): "NVIDIA's CDI kind (cdiKind)",
    ("vgpu/node/config.py", "nvidia.com/gpu"): "cdiKind's default, NVIDIA's CDI kind",
}


def _bounded(literal: str, prefix: bool) -> re.Pattern[str]:
    end = "" if prefix else r"(?![\w./])"
    return re.compile(r"(?<![\w.-])" + re.escape(literal) + end)


PATTERNS = {h.literal: _bounded(h.literal, h.prefix) for h in HOMES}


def _modules() -> list[Path]:
    found = []
    for root in SCANNED:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(GENERATED):
                found.append(path)
    return found


def _strings(tree: ast.AST) -> list[str]:
    """The string constants of a module that are a name, a key or a path: docstrings, bare string
    statements and prose (a constant with a space: a message or a help text naming the contract)
    left out."""
    prose = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in prose
        and not any(c.isspace() for c in node.value)
    ]


def _path_parts(tree: ast.AST) -> set[tuple[str, str]]:
    """Consecutive string segments of ``a / "x" / "y"`` path expressions (``("dra", "claims")``)."""
    pairs = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Div)
            and isinstance(node.right, ast.Constant)
            and isinstance(node.right.value, str)
            and isinstance(node.left, ast.BinOp)
            and isinstance(node.left.op, ast.Div)
            and isinstance(node.left.right, ast.Constant)
            and isinstance(node.left.right.value, str)
        ):
            pairs.add((node.left.right.value, node.right.value))
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Div)
            and isinstance(node.right, ast.Constant)
            and isinstance(node.right.value, str)
        ):
            pairs.add(("*", node.right.value))  # ``dra_dir(d) / "claims"``: the folder built in two steps
    return pairs


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    if rel.parts[0] == "sandbox":
        rel = rel.relative_to("sandbox")
    return ".".join(rel.with_suffix("").parts).removesuffix(".__init__")


def homes() -> dict[str, set[str]]:
    """literal -> the modules that write it."""
    found: dict[str, set[str]] = {h.literal: set() for h in HOMES}
    for path in _modules():
        tree = ast.parse(path.read_text(), str(path))
        strings = _strings(tree)
        pairs = _path_parts(tree)
        rel = path.relative_to(ROOT).as_posix()
        for h in HOMES:
            if (rel, h.literal) in NOT_A_COPY:
                continue
            *_, last = h.literal.split("/")
            in_path = h.path and (tuple(h.literal.split("/")[-2:]) in pairs or ("*", last) in pairs)
            if any(PATTERNS[h.literal].search(s) for s in strings) or in_path:
                found[h.literal].add(_module_name(path))
    return found


@pytest.mark.parametrize("home", HOMES, ids=lambda h: h.literal)
def test_the_owner_holds_the_literal(home: Home) -> None:
    value: object = importlib.import_module(home.owner)
    for part in home.name.split("."):
        value = getattr(value, part)
    assert str(value) == home.literal


def test_each_contract_literal_is_written_in_its_owner_alone() -> None:
    found = homes()
    extra = {h.literal: sorted(found[h.literal] - {h.owner}) for h in HOMES if found[h.literal] - {h.owner}}
    assert not extra, (
        "a contract's literal written outside its owner (import it from the owner instead): "
        + "; ".join(
            f"{lit!r} (owner {next(h.owner for h in HOMES if h.literal == lit)}) in {mods}"
            for lit, mods in extra.items()
        )
    )


def test_the_scan_finds_a_copy_so_the_check_above_can_fail(tmp_path: Path) -> None:
    source = (
        'DRIVER = "vgpu.openaios.io"\n'
        'PLUGIN_DIR = "/var/lib/kubelet/plugins/vgpu.openaios.io"\n'
        'SOCK = f"{x}/vgpu.openaios.io-reg.sock"\n'
        'def records(d):\n    """Under <state>/dra/claims."""\n    return d / "dra" / "claims"\n'
        'NOT = ["vgpu.openaios.io/devices", "mps.vgpu.openaios.io", "x.vgpu.openaios.io"]\n'
        'MEM = "nvidia.com/gpumem"\n'
        'HELP = "the DeviceClass vgpu.openaios.io (prose, not a home)"\n'
    )
    tree = ast.parse(source)
    strings = _strings(tree)
    driver = PATTERNS["vgpu.openaios.io"]
    assert [s for s in strings if driver.search(s)] == [
        "vgpu.openaios.io",
        "/var/lib/kubelet/plugins/vgpu.openaios.io",
        "/vgpu.openaios.io-reg.sock",
    ]
    assert not any(PATTERNS["nvidia.com/gpu"].search(s) for s in strings)
    assert ("dra", "claims") in _path_parts(tree)
    assert ("*", "claims") in _path_parts(ast.parse('p = dra_dir(d) / "claims"'))
    assert "Under <state>/dra/claims." not in strings  # a docstring is prose, not a home


# --- the chart and the docs, held to the owner's value --------------------------------------------


def _template(name: str) -> str:
    return (CHART / "templates" / name).read_text()


def test_the_charts_device_classes_and_plugin_folders_are_the_owners() -> None:
    from vgpu.core.claimconfig import DRIVER, MPS_CLASS
    from vgpu.dra import server
    from vgpu.dra.migslices import MIG_CLASS

    classes = re.findall(r"^  name: (\S+)$", _template("dra-deviceclass.yaml"), re.M)
    assert classes == [DRIVER, MPS_CLASS, MIG_CLASS]
    for expression in re.findall(r"expression: (.*)$", _template("dra-deviceclass.yaml"), re.M):
        assert f'device.driver == "{DRIVER}"' in expression
    daemonset = _template("dra-daemonset.yaml")
    # the kubelet's folder of the driver: <kubeletPlugins>/<driver>, as the plugin's default is
    assert f'printf "%s/{DRIVER}"' in daemonset
    assert server.PLUGIN_DIR.name == DRIVER
    import yaml

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    paths = values["dra"]["hostPaths"]
    assert Path(paths["kubeletPlugins"]) / DRIVER == server.PLUGIN_DIR
    assert paths["kubeletPluginsRegistry"] == str(server.REGISTRY_DIR)
    boundary = _template("tenant-boundary.yaml")
    assert f"opaque.driver.orValue('') == '{DRIVER}'" in boundary


def test_the_charts_labels_annotations_and_ports_are_the_owners() -> None:
    import yaml

    from vgpu.core import annotations as ann
    from vgpu.core.config import SchedulerConfig
    from vgpu.core.gpumode import DRA, GPU_MODE_LABEL

    assert f'(dict "{GPU_MODE_LABEL}" "{DRA}")' in _template("dra-daemonset.yaml")
    assert f'"key" "{GPU_MODE_LABEL}"' in _template("_helpers.tpl")
    boundary = _template("tenant-boundary.yaml")
    for key in (ann.ALLOCATION_ANNOTATION, ann.PHASE_ANNOTATION, ann.REASON_ANNOTATION):
        assert f"'{key}'" in boundary
    assert f"startsWith('{ann.PREFIX}')" in boundary
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert str(values["scheduler"]["metrics"]["port"]) == SchedulerConfig.metrics_listen.rsplit(":", 1)[1]


def test_the_charts_managed_resources_and_priority_rules_are_the_owners() -> None:
    from vgpu.core.boundary import CLAIM_PRIORITY, POD_PRIORITY
    from vgpu.core.mig import RESOURCE_PREFIX, mig_resources
    from vgpu.core.requests import RESOURCE_PRIORITY, RESOURCES

    config = _template("scheduler-config.yaml")
    managed = re.findall(r"^\s+- name: (nvidia\.com/[\w.-]+)$", config, re.M)
    assert managed == list(RESOURCES), "kube-scheduler must send the extender every resource it reads"
    profiles = re.search(r'range list ((?:"[^"]+" ?)+)', config)
    assert profiles is not None and f"- name: {RESOURCE_PREFIX}{{{{ . }}}}" in config
    assert [RESOURCE_PREFIX + p for p in re.findall(r'"([^"]+)"', profiles.group(1))] == list(mig_resources())
    boundary = _template("tenant-boundary.yaml")
    assert f"[?'{RESOURCE_PRIORITY}']" in boundary
    assert f"'{POD_PRIORITY}' : '{CLAIM_PRIORITY}'" in boundary


def test_docs_contracts_names_each_literal_and_its_owner() -> None:
    doc = CONTRACTS_DOC.read_text()
    table = doc.split("## Contract 1", 1)[0]
    for h in HOMES:
        if h.contract == 0:
            continue
        path = "vgpu/" + h.owner.removeprefix("vgpu.").replace(".", "/") + ".py"
        assert f"`{h.literal}" in doc, f"docs/contracts.md does not name {h.literal!r}"
        assert path in doc, f"docs/contracts.md does not name {h.literal!r}'s owner {path}"
    assert "| owner |" in table
