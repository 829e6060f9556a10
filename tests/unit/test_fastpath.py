"""The start-up check of the extender's hand-written parts: each runs only with the library version
it was tested with (the lock's), else the stock path runs and one log line says why."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from vgpu.core.config import SchedulerConfig
from vgpu.extender import fastpath
from vgpu.extender.server import ExtenderServer

TESTED = {"gunicorn": "27.0.1", "kubernetes": "37.0.2"}


def test_with_the_tested_versions_the_hand_written_parts_run_and_nothing_is_said() -> None:
    paths = fastpath.choose({}, TESTED.get, TESTED)
    assert (paths.worker, paths.wire, paths.notes) == (True, True, ())


def test_another_gunicorn_gets_gthread_and_one_line_naming_both_versions(
    caplog: pytest.LogCaptureFixture,
) -> None:
    installed = {**TESTED, "gunicorn": "28.0.0"}
    paths = fastpath.choose({}, installed.get, TESTED)
    assert (paths.worker, paths.wire) == (False, True)
    with caplog.at_level(logging.WARNING, logger="vgpu.extender.fastpath"):
        fastpath.report(paths)
    assert len(caplog.records) == 1
    line = caplog.records[0].getMessage()
    assert "gunicorn 28.0.0" in line and "27.0.1" in line and "stock path" in line


def test_another_kubernetes_client_gets_the_generated_client_for_everything() -> None:
    installed = {**TESTED, "kubernetes": "36.1.0"}
    paths = fastpath.choose({}, installed.get, TESTED)
    assert (paths.worker, paths.wire) == (True, False)
    assert len(paths.notes) == 1 and "kubernetes 36.1.0" in paths.notes[0]


def test_a_missing_library_reads_as_another_version() -> None:
    paths = fastpath.choose({}, {"kubernetes": "37.0.2"}.get, TESTED)
    assert not paths.worker and "not installed" in paths.notes[0]


def test_a_part_turned_off_in_the_environment_takes_the_stock_path_silently() -> None:
    paths = fastpath.choose({fastpath.WORKER_ENV: "off", fastpath.WIRE_ENV: "0"}, TESTED.get, TESTED)
    assert (paths.worker, paths.wire, paths.notes) == (False, False, ())


def test_the_tested_versions_are_the_installed_ones_here() -> None:
    """The development venv is installed from the lock (make venv), so here the parts run."""
    assert fastpath.choose({}).notes == ()


@pytest.mark.parametrize(
    ("gunicorn", "worker_class"),
    [("27.0.1", "vgpu.extender.worker.LingeringThreadWorker"), ("23.0.0", "gthread")],
)
def test_the_server_runs_the_worker_the_check_chose(
    monkeypatch: pytest.MonkeyPatch, gunicorn: str, worker_class: str
) -> None:
    installed = {**TESTED, "gunicorn": gunicorn}
    monkeypatch.setattr(fastpath, "installed", installed.get)
    server = ExtenderServer(SchedulerConfig(listen="127.0.0.1:0"))
    assert server.cfg.settings["worker_class"].get() == worker_class


@pytest.mark.parametrize("wire", [True, False])
def test_the_client_takes_the_wire_path_only_when_chosen(tmp_path: Path, wire: bool) -> None:
    from vgpu.kube.client import Kube

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1', insecure-skip-tls-verify: true}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    kube = Kube(str(kubeconfig), wire=wire)
    try:
        assert (kube._wire is not None) == wire
    finally:
        kube.close()
