"""Acting as a tenant, or as a node's token, against the sandbox's API server (docs/security.md).

A tenant is a ServiceAccount bound to the built-in ``edit`` ClusterRole in its own namespace only:
what a team given a namespace of a shared cluster usually has. The tests act as it through
kubectl's impersonation (``--as`` and its groups), as its own token would authenticate.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import yaml
from vgpu_sandbox import product
from vgpu_sandbox.cluster import Sandbox

POLICY_PREFIX = "vgpu-kube-system-"  # the chart's policies for release vgpu in kube-system
# kubectl's flags to act as the scheduler's account, which alone places pods (the sandbox's
# "vgpu" identity, or an admin, impersonates it as the sandbox's own extender does)
AS_SCHEDULER = (f"--as={product.SCHEDULER_ACCOUNT}", "--as-group=system:masters")
# the sandbox's own webhook checks the placement and priority rules too, with the same words
WEBHOOK = 'admission webhook "validate.vgpu.openaios.io"'


class Tenant:
    def __init__(self, sandbox: Sandbox, namespace: str, account: str = "alice") -> None:
        self.sandbox = sandbox
        self.namespace = namespace
        self.user = f"system:serviceaccount:{namespace}:{account}"
        self.account = account
        self.groups = (
            "system:serviceaccounts",
            f"system:serviceaccounts:{namespace}",
            "system:authenticated",
        )

    def create(self) -> None:
        """The namespace, the account and its ``edit`` RoleBinding (the cluster admin's doing)."""
        sb = self.sandbox
        sb.kubectl("create", "namespace", self.namespace)
        sb.kubectl("create", "serviceaccount", self.account, "-n", self.namespace)
        sb.kubectl(
            "create", "rolebinding", f"{self.account}-edit", "--clusterrole=edit",
            f"--serviceaccount={self.namespace}:{self.account}", "-n", self.namespace,
        )  # fmt: skip

    def delete(self) -> None:
        self.sandbox.kubectl("delete", "namespace", self.namespace, "--wait=false", check=False)

    def kubectl(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        """kubectl as the tenant, in its namespace; never raises (the refusal is the point)."""
        who = [f"--as={self.user}", *(f"--as-group={g}" for g in self.groups)]
        return self.sandbox.kubectl(*who, "-n", self.namespace, *args, input=input, check=False)

    def apply(self, obj: dict[str, Any], verb: str = "create") -> subprocess.CompletedProcess[str]:
        return self.kubectl(verb, "-f", "-", input=json.dumps(obj))


def token_kubeconfig(sandbox: Sandbox, token: str, path: Path) -> Path:
    """The sandbox's cluster and CA, with a ServiceAccount token as the user."""
    kc = yaml.safe_load(sandbox.kubeconfig.read_text())
    ctx = next(c for c in kc["contexts"] if c["name"] == kc["current-context"])["context"]
    cluster = next(c for c in kc["clusters"] if c["name"] == ctx["cluster"])
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [cluster],
                "users": [{"name": "sa", "user": {"token": token}}],
                "contexts": [{"name": "sa", "context": {"cluster": cluster["name"], "user": "sa"}}],
                "current-context": "sa",
            }
        )
    )
    return path


def as_kubeconfig(
    sandbox: Sandbox, kubeconfig: Path, *args: str, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """kubectl with another identity's kubeconfig (a node's plugin, a minted token); never raises."""
    argv = [str(sandbox.bin("kubectl")), f"--kubeconfig={kubeconfig}", *args]
    return subprocess.run(argv, input=input, capture_output=True, text=True, timeout=60, check=False)


def refused_by(result: subprocess.CompletedProcess[str], *policies: str) -> str:
    """The refusal's message, after checking that one of the chart's ``policies`` made it (where
    two rules refuse one write, the API server names the first it evaluated)."""
    assert result.returncode != 0, f"expected a refusal by {policies}, but it was allowed: {result.stdout}"
    markers = [f"ValidatingAdmissionPolicy '{POLICY_PREFIX}{p}'" for p in policies]
    if {"placements", "priority"} & set(policies):
        markers.append(WEBHOOK)  # which of the two answers first is the API server's choice
    assert any(m in result.stderr for m in markers), result.stderr
    return result.stderr.split("denied request: ", 1)[-1].split("denied the request: ", 1)[-1].strip()
