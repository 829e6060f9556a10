"""The project's playbooks run against a sandbox, as the e2e tests run them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from vgpu_sandbox.cluster import Sandbox

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")


def play(
    sandbox: Sandbox, playbook: str, *extra: str, inventory: Path | None = None, timeout: float = 540
) -> subprocess.CompletedProcess[str]:
    """``ansible-playbook -i INVENTORY playbooks/PLAYBOOK`` (default inventory/sandbox.yml) with the
    sandbox's kubeconfig and binaries, output captured without colour."""
    env = dict(
        os.environ,
        KUBECONFIG=str(sandbox.kubeconfig),
        VGPU_BIN_DIR=str(sandbox.bin("helm").parent.parent),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_COLOR="0",
    )
    return subprocess.run(
        [
            str(ANSIBLE_PLAYBOOK),
            "-i",
            str(inventory or ROOT / "inventory" / "sandbox.yml"),
            str(ROOT / "playbooks" / playbook),
            *extra,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def play_recap(result: subprocess.CompletedProcess[str]) -> dict[str, dict[str, int]]:
    """PLAY RECAP as {host: {ok: N, changed: N, ...}}."""
    text = result.stdout.split("PLAY RECAP", 1)[-1]
    return {
        host: {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", counts)}
        for host, counts in re.findall(r"^(\S+)\s+:\s+(.*)$", text, re.M)
    }
