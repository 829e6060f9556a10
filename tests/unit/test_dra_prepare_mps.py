"""Prepare of a share on a card the node shares through MPS (``--sharing-mode mps``,
vgpu/dra/prepare_mps.py), on real files: the grant is an MPS client's, the CDI spec mounts the
card's pipe folder read-only with the CUDA_MPS_* variables, and a claim configured for the other
mode, a request of two cards or a card with no MPS daemon is refused with nothing written."""

from __future__ import annotations

import json
import socket
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_dra_prepare import CARDS, NODE, UID, Claims, claim, opaque, result
from vgpu.core.claimconfig import ConfigEntryError, parse_parameters
from vgpu.dra import cdi
from vgpu.dra.claims import ClaimError
from vgpu.dra.prepare import Preparer, StatePaths, folder_name
from vgpu.hookabi.grant import read_grant
from vgpu.hookabi.layout import MPS_PIPE_IN_CONTAINER, SHARING_MPS, SHARING_TIMESLICE
from vgpu.node.config import NodeConfig

_LISTENING: list[socket.socket] = []  # the stand-in daemons' control sockets, open for the session


def listening(pipe: Path) -> None:
    """A control socket answering at ``pipe``/control, as the card's MPS daemon's does: bound at a
    short path (a unix socket path is at most 107 bytes) and linked there."""
    pipe.mkdir(parents=True)
    where = Path(tempfile.mkdtemp(prefix="vdp", dir="/tmp")) / "control"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(where))
    s.listen(8)
    _LISTENING.append(s)
    (pipe / "control").symlink_to(where)


def preparer(tmp_path: Path, claims: Claims, sharing: str = "mps", daemons: bool = True) -> Preparer:
    paths = StatePaths(Path("/"), tmp_path / "state")
    if daemons:  # the card's MPS control daemon answering (vgpu/node/mps.py starts it)
        for card in CARDS:
            listening(paths.mps_pipe(card.uuid))
    return Preparer(NODE, paths, tmp_path / "cdi", NodeConfig(), claims, lambda: list(CARDS), sharing=sharing)


def edits(tmp_path: Path) -> dict[str, Any]:
    spec = json.loads(cdi.spec_path(tmp_path / "cdi", UID).read_text())
    return dict(spec["devices"][0]["containerEdits"])


def test_an_mps_share_is_an_mps_clients_grant_with_the_pipe_mounted_read_only(tmp_path: Path) -> None:
    preparer(tmp_path, Claims(claim())).prepare("ns", UID, "c")
    grant = read_grant(tmp_path / "state/grants" / f"{folder_name(UID, 'gpu')}.limits")
    assert (grant.sharing, grant.mps_pipe) == (SHARING_MPS, MPS_PIPE_IN_CONTAINER)
    assert grant.limits == (3000 << 20,) and grant.sm_limits == (30,)
    got = edits(tmp_path)
    env = dict(e.split("=", 1) for e in got["env"])
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == MPS_PIPE_IN_CONTAINER == "/var/run/vgpu/mps"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=3000M"
    mounts = {m["containerPath"]: m for m in got["mounts"]}
    pipe = mounts[MPS_PIPE_IN_CONTAINER]
    assert pipe["hostPath"] == str(tmp_path / "state/mps/GPU-a/pipe") and "ro" in pipe["options"]


def test_a_timeslice_node_writes_no_mps_and_a_claim_may_say_either_mode_it_matches(tmp_path: Path) -> None:
    c = claim(config=[opaque("FromClaim", sharing="timeslice")])
    preparer(tmp_path, Claims(c), sharing="timeslice", daemons=False).prepare("ns", UID, "c")
    grant = read_grant(tmp_path / "state/grants" / f"{folder_name(UID, 'gpu')}.limits")
    assert (grant.sharing, grant.mps_pipe) == (SHARING_TIMESLICE, "")
    got = edits(tmp_path)
    assert not [e for e in got["env"] if e.startswith("CUDA_MPS_")]
    assert MPS_PIPE_IN_CONTAINER not in {m["containerPath"] for m in got["mounts"]}
    other = tmp_path / "mps"
    other.mkdir()
    preparer(other, Claims(claim(config=[opaque("FromClass", sharing="mps")]))).prepare("ns", UID, "c")


@pytest.mark.parametrize(
    ("node", "asked", "words"),
    [
        (
            "timeslice",
            "mps",
            "configured sharing: mps, but it was allocated on a card this node shares as timeslice",
        ),
        (
            "mps",
            "timeslice",
            "configured sharing: timeslice, but it was allocated on a card this node shares as mps",
        ),
    ],
)
def test_a_config_whose_sharing_differs_from_the_cards_is_refused_and_nothing_written(
    tmp_path: Path, node: str, asked: str, words: str
) -> None:
    p = preparer(tmp_path, Claims(claim(config=[opaque("FromClaim", sharing=asked)])), sharing=node)
    with pytest.raises(ClaimError) as err:
        p.prepare("ns", UID, "c")
    assert words in str(err.value) and "ResourceClaim ns/c" in str(err.value)
    assert err.value.field.endswith("opaque.parameters.sharing")
    assert not (tmp_path / "state/grants").exists() and p.checkpoint.get(UID) is None


def test_an_mps_request_of_two_cards_or_on_a_card_without_its_daemon_is_refused(tmp_path: Path) -> None:
    two = claim([result(), result(device="gpu-1", shareID="s2")])
    with pytest.raises(ClaimError, match="holds 2 cards shared through MPS"):
        preparer(tmp_path, Claims(two)).prepare("ns", UID, "c")
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(ClaimError, match="MPS control daemon does not answer at .*: it is not running"):
        preparer(bare, Claims(claim()), daemons=False).prepare("ns", UID, "c")
    folder_only = tmp_path / "folder-only"  # a pipe folder left by a daemon that died
    StatePaths(Path("/"), folder_only / "state").mps_pipe(CARDS[0].uuid).mkdir(parents=True)
    with pytest.raises(ClaimError, match="MPS control daemon does not answer"):
        preparer(folder_only, Claims(claim()), daemons=False).prepare("ns", UID, "c")


def test_vgpu_config_reads_sharing_and_refuses_another_value_naming_the_field() -> None:
    base = {"apiVersion": "vgpu.openaios.io/v1", "kind": "VgpuConfig"}
    assert parse_parameters({**base, "sharing": "mps"}, "p", "claim").sharing == "mps"
    assert parse_parameters(base, "p", "claim").sharing is None
    with pytest.raises(ConfigEntryError) as err:
        parse_parameters({**base, "sharing": "spatial"}, "p", "claim")
    assert err.value.field == "p.sharing" and "mps.vgpu.openaios.io" in str(err.value)
