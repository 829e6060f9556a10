"""The real node in DRA mode, as `vgpu sandbox up --real-node --dra` starts it
(tests/e2e/test_sandbox_dra.py runs it over the stub driver, tests/gpu/test_dra_gpu.py on a GPU)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml
from vgpu_sandbox import product, realdra
from vgpu_sandbox.cli import register
from vgpu_sandbox.cluster import Sandbox, Spec
from vgpu_sandbox.errors import SandboxError


def _flags(argv: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)


@pytest.fixture
def hook(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    lib = tmp_path / "libvgpu.so"
    lib.write_bytes(b"")
    monkeypatch.setattr(product, "hook_library", lambda: lib)
    return lib


def test_on_the_stub_the_plugin_reads_the_fake_cards_and_the_sandbox_kubelets_folders(
    tmp_path: Path, hook: Path
) -> None:
    box, root = Sandbox(tmp_path / "sb"), tmp_path / "real-node"
    root.mkdir()
    argv = realdra.argv(
        box,
        Spec(nodes=0, real_node=True, dra=True),
        "real-node-0",
        root,
        root / "kubelet",
        root / "gpus.yaml",
    )
    flags = _flags(argv)
    assert argv[3] == "dra-plugin" and flags["node-name"] == "real-node-0"
    assert flags["plugin-dir"] == str(root / "kubelet/plugins/vgpu.openaios.io")
    assert flags["registry-dir"] == str(root / "kubelet/plugins_registry")
    assert flags["state-dir"] == str(root / "vgpu-dra") and flags["cdi-dir"] == "/var/run/cdi"
    assert flags["fake-nvml"] == str(root / "gpus.yaml") and flags["hook-library"] == str(hook)
    assert flags["kubeconfig"] == str(box.kubeconfig)
    # the stub driver comes with the sample image: the spec carries no driver files
    assert "driverInject" not in yaml.safe_load(Path(flags["config"]).read_text())


def test_on_a_real_gpu_the_plugin_reads_nvml_and_hands_out_the_driver(tmp_path: Path, hook: Path) -> None:
    root = tmp_path / "real-node"
    root.mkdir()
    spec = Spec(nodes=0, real_node=True, real_gpu=True, dra=True)
    flags = _flags(
        realdra.argv(Sandbox(tmp_path / "sb"), spec, "n", root, root / "kubelet", root / "gpus.yaml")
    )
    assert "fake-nvml" not in flags
    assert yaml.safe_load(Path(flags["config"]).read_text())["driverInject"] == "plugin"


def test_without_the_hook_built_the_error_names_make_native(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(product, "hook_library", lambda: None)
    with pytest.raises(SandboxError, match="make native"):
        realdra.argv(
            Sandbox(tmp_path / "sb"), Spec(real_node=True, dra=True), "n", tmp_path, tmp_path, tmp_path
        )


def test_dra_needs_the_real_node_and_no_chart_scheduler() -> None:
    with pytest.raises(SandboxError, match="--dra needs --real-node"):
        Spec(dra=True).validate()
    with pytest.raises(SandboxError, match="--scheduler-in-cluster"):
        Spec(nodes=0, real_node=True, dra=True, local_scheduler=False).validate()
    Spec(nodes=0, real_node=True, real_gpu=True, dra=True).validate()


def test_the_cli_flag_reaches_the_spec() -> None:
    parser = argparse.ArgumentParser()
    register(parser)
    args = parser.parse_args("up --real-node --real-gpu --dra --nodes 0".split())  # parsed, never started
    assert args.dra and args.real_gpu and args.real_node


def test_specs_of_claims_left_prepared_are_removed_and_no_others(tmp_path: Path) -> None:
    root, cdi = tmp_path / "real-node", tmp_path / "cdi"
    claims = realdra.state_dir(root) / "dra" / "claims"
    claims.mkdir(parents=True)
    cdi.mkdir()
    (claims / "uid-1.json").write_text("{}")
    (claims / "uid-2.json").write_text("{}")
    (cdi / "vgpu.openaios.io-claim_uid-1.json").write_text("{}")
    (cdi / "other-vendor.json").write_text("{}")
    assert realdra.forget_specs(root, cdi) == [cdi / "vgpu.openaios.io-claim_uid-1.json"]
    assert sorted(p.name for p in cdi.iterdir()) == ["other-vendor.json"]
    assert realdra.forget_specs(tmp_path / "nothing", cdi) == []


def test_mig_needs_dra_on_the_stub_and_turns_the_plugins_mig_on(tmp_path: Path, hook: Path) -> None:
    with pytest.raises(SandboxError, match="--mig dynamic on the real node needs --dra"):
        Spec(nodes=0, real_node=True, mig="dynamic").validate()
    with pytest.raises(SandboxError, match="--mig single or mixed is for the simulated nodes"):
        Spec(nodes=0, real_node=True, dra=True, mig="mixed").validate()
    with pytest.raises(SandboxError, match="leave out --real-gpu"):
        Spec(nodes=0, real_node=True, real_gpu=True, dra=True, mig="dynamic").validate()
    root = tmp_path / "real-node"
    root.mkdir()
    spec = Spec(nodes=0, real_node=True, dra=True, mig="dynamic")
    spec.validate()
    argv = realdra.argv(Sandbox(tmp_path / "sb"), spec, "n", root, root / "kubelet", root / "gpus.yaml")
    assert _flags(argv)["mig"] == "dynamic"
    plain = Spec(nodes=0, real_node=True, dra=True)
    assert "mig" not in _flags(
        realdra.argv(Sandbox(tmp_path / "sb"), plain, "n", root, root / "k", root / "g")
    )
    parser = argparse.ArgumentParser()
    register(parser)
    assert parser.parse_args("up --real-node --dra --mig dynamic --nodes 0".split()).mig == "dynamic"


def test_the_sandboxs_device_classes_are_the_charts() -> None:
    from vgpu_sandbox import realdra

    from vgpu.dra.migslices import MPS_SELECTOR, SHARED_SELECTOR

    for cls, expr in ((realdra.DEVICE_CLASS, SHARED_SELECTOR), (realdra.MPS_DEVICE_CLASS, MPS_SELECTOR)):
        assert cls["spec"]["selectors"] == [{"cel": {"expression": expr}}]
