"""The chart's values: documented, covered by the schema, and bad ones refused by helm with the
value and the fix named; and the RBAC they produce grants each component only what it uses."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml
from chart_support import CHART, REPO, template


def leaves(doc: Any, prefix: str = "") -> set[str]:
    """Dotted paths of the values; maps with entries are walked, everything else is a leaf."""
    if isinstance(doc, dict) and doc:
        out: set[str] = set()
        for key, value in doc.items():
            out |= {prefix + key} | leaves(value, prefix + key + ".")
        return out
    return set()


def schema_paths(schema: dict[str, Any], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for key, sub in (schema.get("properties") or {}).items():
        out |= {prefix + key} | schema_paths(sub, prefix + key + ".")
    return out


# Maps the chart fills with free-form Kubernetes content (selectors, resources, labels...).
FREE_FORM = re.compile(
    r"(\.resources|\.requests|\.limits|\.nodeSelector|Selector|\.matchExpressions)(\.|$)|^global\.labels\."
)


def test_values_and_schema_declare_the_same_keys() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    in_values = {p for p in leaves(values) if not FREE_FORM.search(p)}
    in_schema = {p for p in schema_paths(schema) if not FREE_FORM.search(p)}
    assert in_values - in_schema == set(), "values.yaml keys the schema does not declare"
    assert in_schema - in_values == set(), "schema keys values.yaml does not set"


# Keys whose contents are plain Kubernetes fields (resources, selectors): the comment above the
# key itself documents them.
KUBERNETES_BLOCKS = {"resources", "nodeSelector", "namespaceSelector", "objectSelector", "tolerations"}


def test_every_value_has_a_comment_above_it() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    stack: list[tuple[int, str]] = []  # (indent, key) of the keys enclosing the current line
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z][A-Za-z0-9]*):", line)
        if not m:
            continue
        indent, key = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        inside_kubernetes_block = any(k in KUBERNETES_BLOCKS for _, k in stack)
        stack.append((indent, key))
        if inside_kubernetes_block:
            continue
        prev = lines[i - 1].strip() if i else ""
        # a key is documented by the comment right above it, or is a group whose keys each are
        if not prev.startswith("#") and not _is_group(lines, i, indent):
            undocumented.append(key)
    assert undocumented == []


def _is_group(lines: list[str], i: int, indent: int) -> bool:
    """A key with nothing after the colon whose own keys are deeper (each of them commented)."""
    if lines[i].rstrip().endswith(":") and i + 1 < len(lines):
        nxt = lines[i + 1]
        return len(nxt) - len(nxt.lstrip()) > indent
    return False


BAD_VALUES = [
    # (helm arguments, what the message must name, the fix it must give)
    (
        ["--set", "devicePlugin.deviceMemoryScaling=2"],
        "devicePlugin.deviceMemoryScaling=2",
        "set devicePlugin.virtualMemory.enabled=true",
    ),
    (
        ["--set", "scheduler.replicas=3,scheduler.leaderElection.enabled=false"],
        "scheduler.replicas=3 with scheduler.leaderElection.enabled=false",
        "set scheduler.leaderElection.enabled=true",
    ),
    (
        [
            "--set",
            "devicePlugin.monitor.service.type=NodePort,devicePlugin.monitor.service.nodePort=31993",
            "--set",
            "scheduler.metrics.service.type=NodePort,scheduler.metrics.service.nodePort=31993",
        ],
        "scheduler.metrics.service.nodePort and devicePlugin.monitor.service.nodePort are both 31993",
        "change one of them",
    ),
    (
        ["--set", "scheduler.metrics.service.nodePort=31993"],
        "scheduler.metrics.service.nodePort=31993 only applies to type NodePort",
        "scheduler.metrics.service.nodePort=null",
    ),
    (
        ["--set", "scheduler.kubeScheduler.imageTag=v1.34.1"],
        "scheduler.kubeScheduler.imageTag=v1.34.1 is newer than the cluster (v1.33.0)",
        "leave it empty to follow the cluster",
    ),
    (
        ["--set", "scheduler.kubeScheduler.imageTag=v1.31.9"],
        "scheduler.kubeScheduler.imageTag=v1.31.9 is more than one minor version older than the cluster",
        "set scheduler.kubeScheduler.imageTag to a 1.33.x tag",
    ),
    (
        ["--set", "scheduler.kubeScheduler.imageTag=banana"],
        "scheduler.kubeScheduler.imageTag=banana is not a Kubernetes version",
        "set scheduler.kubeScheduler.imageTag to the cluster's version",
    ),
    (
        ["--set", "scheduler.kubeScheduler.imageTag=1.33.4"],  # registry.k8s.io's tags start with v
        "scheduler.kubeScheduler.imageTag=1.33.4 is not a Kubernetes version",
        "leave it empty to follow the cluster",
    ),
    (
        [
            "--set",
            "scheduler.kubeScheduler.podMaxBackoffSeconds=1,scheduler.kubeScheduler.podInitialBackoffSeconds=5",
        ],
        "scheduler.kubeScheduler.podMaxBackoffSeconds=1 is below",
        "make podMaxBackoffSeconds >= podInitialBackoffSeconds",
    ),
    (
        ["--set", "scheduler.metrics.port=8443"],
        "scheduler.extender.port and scheduler.metrics.port are both 8443",
        "give scheduler.extender.port another port",
    ),
    (
        ["--set", "scheduler.kubeScheduler.port=8443"],
        "scheduler.extender.port and scheduler.kubeScheduler.port are both 8443",
        "give scheduler.extender.port another port",
    ),
    (
        ["--set", "scheduler.extender.route=pod,scheduler.replicas=2"],
        "scheduler.extender.route=pod with scheduler.replicas=2",
        "set scheduler.replicas=1, or scheduler.extender.route=service",
    ),
    (
        ["--set", "devicePlugin.nodeOverrides[0].name=n1,devicePlugin.nodeOverrides[1].name=n1"],
        "devicePlugin.nodeOverrides[1].name=n1 repeats an earlier entry",
        "merge the two entries for n1",
    ),
    (
        [
            "--set",
            "devicePlugin.nodeOverrides[0].name=big,devicePlugin.nodeOverrides[0].deviceMemoryScaling=3",
        ],
        "devicePlugin.nodeOverrides[0] (node big) has deviceMemoryScaling=3",
        "add virtualMemory: true to that entry",
    ),
    (
        ["--set", "scheduler.metrics.service.enabled=false,devicePlugin.monitor.service.enabled=false"],
        "monitoring.serviceMonitor.enabled=true",
        "set monitoring.serviceMonitor.enabled=false",
    ),
    (
        ["--set", "devicePlugin.deviceCoreScaling=0.0"],
        "devicePlugin.deviceCoreScaling=0.0 is out of range",
        "use a number above 0 and at most 100",
    ),
    # mistyped: wrong key, wrong type, out of range, not one of the choices
    (["--set", "devicePlugin.deviceSplitcount=5"], "/devicePlugin", "'deviceSplitcount' not allowed"),
    (
        ["--set-string", "devicePlugin.deviceSplitCount=five"],
        "/devicePlugin/deviceSplitCount",
        "want integer",
    ),
    (["--set", "devicePlugin.deviceSplitCount=0"], "/devicePlugin/deviceSplitCount", "minimum"),
    (["--set", "scheduler.extender.nodePolicy=fastest"], "/scheduler/extender/nodePolicy", "binpack"),
    (["--set", "webhook.failurePolicy=fail"], "/webhook/failurePolicy", "Ignore"),
    (
        ["--set", "scheduler.extender.extraEnv[0].name=SHORT-PARSER,scheduler.extender.extraEnv[0].value=x"],
        "/scheduler/extender/extraEnv/0/name",
        "does not match",
    ),
    (["--set", "devicePlugin.extraArgs[0]=fake-nvml"], "/devicePlugin/extraArgs/0", "does not match"),
    (
        ["--set", "devicePlugin.extraVolumeMounts[0].name=x"],
        "/devicePlugin/extraVolumeMounts/0",
        "missing property 'mountPath'",
    ),
    (["--set-string", "devicePlugin.hostNetwork=yes"], "/devicePlugin/hostNetwork", "want boolean"),
    (["--set", "devicePlugin.image.digest=sha256:abc"], "/devicePlugin/image/digest", "does not match"),
    (
        ["--set", "scheduler.extender.image.digest=" + "b" * 64],  # without "sha256:"
        "/scheduler/extender/image/digest",
        "does not match",
    ),
]


@pytest.mark.parametrize(("args", "names", "fix"), BAD_VALUES, ids=lambda v: str(v)[:60])
def test_bad_values_fail_with_the_value_and_the_fix_named(args: list[str], names: str, fix: str) -> None:
    result = template(*args)
    assert result.returncode != 0, f"helm accepted {args}"
    assert names in result.stderr
    assert fix in result.stderr


def test_sound_values_render_no_validation_output() -> None:
    result = template("--show-only", "templates/validation.yaml")
    # helm reports a template that renders nothing as "could not find template" for --show-only
    assert "could not find template" in result.stderr


def _rbac(objs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """ServiceAccount name -> every rule bound to it (Roles and ClusterRoles of this chart)."""
    roles = {
        (o["kind"], o["metadata"]["name"]): o.get("rules", []) for o in objs if o["kind"].endswith("Role")
    }
    out: dict[str, list[dict[str, Any]]] = {}
    for b in (o for o in objs if o["kind"].endswith("RoleBinding")):
        for s in b["subjects"]:
            out.setdefault(s["name"], []).extend(roles.get((b["roleRef"]["kind"], b["roleRef"]["name"]), []))
    return out


def test_each_component_runs_as_its_own_service_account_on_an_expiring_projected_token() -> None:
    result = template()
    assert result.returncode == 0, result.stderr
    objs = [o for o in yaml.safe_load_all(result.stdout) if o]
    accounts = {o["metadata"]["name"] for o in objs if o["kind"] == "ServiceAccount"}
    assert accounts == {"vgpu-scheduler", "vgpu-device-plugin"}
    deploy = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    ds = next(o for o in objs if o["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    assert deploy["serviceAccountName"] == "vgpu-scheduler"
    assert ds["serviceAccountName"] == "vgpu-device-plugin"
    # kube-scheduler and the extender share the pod's projected token (kubelet renews it): no
    # container mounts another token, and the chart makes no long-lived token Secret
    assert deploy.get("automountServiceAccountToken", True) is True
    for c in deploy["containers"]:
        paths = [m["mountPath"] for m in c.get("volumeMounts", [])]
        assert "/var/run/secrets/kubernetes.io/serviceaccount" not in paths, c["name"]
    assert not [
        o for o in objs if o["kind"] == "Secret" and o.get("type") == "kubernetes.io/service-account-token"
    ]


def test_no_component_may_read_secrets_or_use_wildcards() -> None:
    result = template()
    objs = [o for o in yaml.safe_load_all(result.stdout) if o]
    rules = _rbac(objs)
    assert set(rules) >= {"vgpu-device-plugin", "vgpu-scheduler"}
    for account, account_rules in rules.items():
        for rule in account_rules:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], (account, rule)
            assert "secrets" not in rule["resources"], (account, rule)
    plugin = {
        (r, v) for rule in rules["vgpu-device-plugin"] for r in rule["resources"] for v in rule["verbs"]
    }
    assert ("pods/binding", "create") not in plugin and ("nodes", "list") not in plugin
    scheduler_bindings = [
        o["roleRef"]["name"]
        for o in objs
        if o["kind"] == "ClusterRoleBinding" and o["subjects"][0]["name"] == "vgpu-scheduler"
    ]
    assert sorted(scheduler_bindings) == [
        "system:kube-scheduler",
        "system:volume-scheduler",
        "vgpu-kube-system-extender",
    ]


def _image_names_built(text: str) -> dict[str, str]:
    """What tools/images.sh names each image it builds: {"scheduler": "docker.io/vgpu/scheduler:$tag"}."""
    return dict(re.findall(r"^\s*\[([a-z-]+)\]=(\S+)$", text, re.M))


def test_the_images_the_chart_pulls_are_the_ones_both_builds_make() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    pulled = {
        "scheduler": values["scheduler"]["extender"]["image"],
        "device-plugin": values["devicePlugin"]["image"],
    }
    built = _image_names_built((REPO / "tools" / "images.sh").read_text())
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^IMAGE_TAG \?= dev$", makefile, re.M)
    assert "-t docker.io/vgpu/$$(basename $$f .Dockerfile):$(IMAGE_TAG)" in makefile
    assert "VGPU_IMAGE_TAG=$(IMAGE_TAG) bash tools/images.sh" in makefile
    assert "tag=${VGPU_IMAGE_TAG:-dev}" in (REPO / "tools" / "images.sh").read_text()
    for name, image in pulled.items():
        full = f"{image['registry']}/{image['repository']}"
        assert built[name] == f"{full}:$tag"
        assert (REPO / "images" / f"{name}.Dockerfile").exists()
        assert f"-t {full}:dev" in (REPO / "images" / f"{name}.Dockerfile").read_text()
        assert image["tag"] == "" and image["digest"] == ""  # the chart's appVersion, by tag


def test_install_md_says_who_publishes_the_images_and_how_to_push_your_own() -> None:
    text = (REPO / "docs" / "install.md").read_text()
    images = text[text.index("\n## Images") :]
    assert "Nobody publishes" in images
    for command in ("make images-docker IMAGE_TAG=", "docker push", "crane push", "global.imageRegistry"):
        assert command in images, command
    assert "scheduler.kubeScheduler.imageTag" in text[text.index("helm template") :]
