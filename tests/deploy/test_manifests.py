"""The install manifests and the chart agree with each other and with what the operator needs: the same
RBAC rules, the pod labels the jobs' NetworkPolicies admit and the peering object kopf expects (the images'
assumptions: test_images.py)."""

import os
import subprocess
from pathlib import Path

import pytest
import yaml
from cluster.controlplane import binaries_dir, start_control_plane
from kubernetes.client import models as k8s
from support import missing_binary

from diloco.operator.children import OperatorRef
from diloco.operator.main import PEERING_NAME

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "diloco"
MODELS = {
    "ServiceAccount": k8s.V1ServiceAccount,
    "ClusterRole": k8s.V1ClusterRole,
    "ClusterRoleBinding": k8s.V1ClusterRoleBinding,
    "Role": k8s.V1Role,
    "RoleBinding": k8s.V1RoleBinding,
    "Deployment": k8s.V1Deployment,
    "Service": k8s.V1Service,
    "Namespace": k8s.V1Namespace,
}


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def helm() -> Path | None:
    cache = Path(os.environ.get("DILOCO_CLUSTER_CACHE", Path.home() / ".cache" / "diloco-cluster"))
    found = sorted(cache.glob("helm-*/helm")) if cache.is_dir() else []
    return found[-1] if found else None


def render_chart(*sets: str) -> list[dict]:
    binary = helm()
    if binary is None:
        missing_binary("no helm binary (tests/cluster/build.sh builds one)")
    args = [str(binary), "template", "diloco", str(CHART), "--namespace", "diloco-system"]
    for value in sets:
        args += ["--set", value]
    output = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(output) if d]


def rules_of(docs, kind, name=None):
    return [
        r for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name) for r in d["rules"]
    ]


def normalised(rules):
    return sorted((tuple(r["apiGroups"]), tuple(r["resources"]), tuple(sorted(r["verbs"]))) for r in rules)


def test_deploy_manifests_are_valid_objects():
    for path in (ROOT / "deploy" / "rbac.yaml", ROOT / "deploy" / "operator.yaml"):
        for doc in documents(path):
            if doc["kind"] in MODELS:
                MODELS[doc["kind"]].from_dict(doc)


def test_operator_pods_carry_the_labels_job_network_policies_admit():
    deployment = next(d for d in documents(ROOT / "deploy" / "operator.yaml") if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]
    assert OperatorRef("x").pod_labels.items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz", "Ready once kopf serves its health"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["serviceAccountName"] == "diloco-operator"


def test_the_charts_operator_is_ready_once_kopf_serves_its_health():
    deployment = next(d for d in render_chart() if d["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}


def test_the_peering_object_kopf_needs_is_installed():
    peering = [d for d in documents(ROOT / "deploy" / "operator.yaml") if d["kind"] == "ClusterKopfPeering"]
    assert [p["metadata"]["name"] for p in peering] == [PEERING_NAME]


def test_chart_cluster_wide_rbac_is_deploy_rbac():
    chart = render_chart()
    deploy = documents(ROOT / "deploy" / "rbac.yaml")
    assert normalised(rules_of(chart, "ClusterRole")) == normalised(rules_of(deploy, "ClusterRole"))
    assert [d["metadata"]["name"] for d in chart if d["kind"] == "ClusterKopfPeering"] == [PEERING_NAME]
    for doc in chart:
        if doc["kind"] in MODELS:
            MODELS[doc["kind"]].from_dict(doc)
    deployment = next(d for d in chart if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "--all-namespaces" in container["args"] and container["image"] == "diloco-operator:0.1.0"
    assert OperatorRef("x").pod_labels.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_chart_for_named_namespaces_grants_only_those():
    chart = render_chart("watchNamespaces={team-a,team-b}", "metrics.enabled=false")
    # Beside the watched namespaces, only the operator's own key Secret (operator/tokens.py): get that one, create.
    (key,) = [d for d in chart if d["kind"] == "Role" and d["metadata"]["name"].endswith("-token-key")]
    assert key["rules"] == (
        [
            {
                "apiGroups": [""],
                "resources": ["secrets"],
                "resourceNames": ["diloco-operator-token-key"],
                "verbs": ["get"],
            },
            {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
        ]
    )
    chart = [d for d in chart if d is not key and d["metadata"]["name"] != key["metadata"]["name"]]
    roles = {d["metadata"]["namespace"]: d for d in chart if d["kind"] == "Role"}
    assert set(roles) == {"team-a", "team-b"}
    cluster_wide = normalised(rules_of(documents(ROOT / "deploy" / "rbac.yaml"), "ClusterRole"))
    namespaced = normalised(rules_of(chart, "Role")[: len(roles["team-a"]["rules"])])
    nodes = (("",), ("nodes", "namespaces"), ("get",))
    assert normalised(rules_of(chart, "ClusterRole")) == [nodes]
    as_cluster = [r for r in cluster_wide if r != nodes and r[1] != ("clusterkopfpeerings",)]
    assert [r for r in namespaced if r[1] != ("kopfpeerings",)] == as_cluster
    peerings = {d["metadata"]["namespace"] for d in chart if d["kind"] == "KopfPeering"}
    assert peerings == {"team-a", "team-b"}
    args = next(d for d in chart if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--metrics-port=0" in args
    assert not [d for d in chart if d["kind"] == "Service"]


def test_chart_ships_the_rendered_crds_and_says_how_to_upgrade_them():
    assert (CHART / "crds" / "dilocojobs.diloco.dev.yaml").read_text() == (ROOT / "deploy" / "crd.yaml").read_text()
    assert "kubectl apply --server-side -f deploy/crd.yaml" in (CHART / "README.md").read_text()
    assert "deploy/crd.yaml" in (CHART / "templates" / "NOTES.txt").read_text()


def install_commands() -> list[list[str]]:
    """The `-f` files of every `kubectl apply` the install instructions give, each command's in its order."""
    commands = []
    for doc in (ROOT / "README.md", ROOT / "deploy" / "README.md", ROOT / "deploy" / "operator.yaml"):
        for line in doc.read_text().splitlines():
            words = line.split("#", 2)[0 if not line.lstrip().startswith("#") else 1].split()
            if words[:2] == ["kubectl", "apply"] and "deploy/rbac.yaml" in words:
                commands.append([words[i + 1] for i, word in enumerate(words) if word == "-f"])
    return commands


def test_the_install_commands_create_each_namespace_before_what_lives_in_it():
    """kubectl applies its files in order, and an object in a namespace that does not exist yet is refused: on a
    fresh cluster, the operator's ServiceAccount needs its Namespace applied before it."""
    commands = install_commands()
    assert len(commands) == 3, commands
    for files in commands:
        created: set[str] = set()
        for name in files:
            for doc in documents(ROOT / name):
                if doc["kind"] == "Namespace":
                    created.add(doc["metadata"]["name"])
                namespace = doc["metadata"].get("namespace")
                assert namespace is None or namespace in created, f"{' '.join(files)}: {doc['kind']} before {namespace}"


@pytest.mark.process
def test_the_readmes_install_commands_succeed_on_a_fresh_cluster(tmp_path):
    """Each `kubectl apply` of the install instructions, run as written on an API server that has never seen the
    project, after the CRDs they follow."""
    bin_dir = binaries_dir()
    if bin_dir is None:
        missing_binary("no cached kube-apiserver/etcd/kubectl (run tests/cluster/build.sh)")
    for index, files in enumerate(dict.fromkeys(map(tuple, install_commands()))):
        workdir = tmp_path / f"plane-{index}"
        workdir.mkdir()
        plane = start_control_plane(bin_dir, workdir)
        try:
            plane.kubectl("apply", "--server-side", "-f", str(ROOT / "deploy" / "crd.yaml"))
            plane.kubectl("apply", "--server-side", "-f", str(ROOT / "deploy" / "peering-crds.yaml"))
            plane.kubectl(
                "wait", "--for", "condition=established", "--timeout", "60s", "crd/clusterkopfpeerings.kopf.dev"
            )
            result = plane.kubectl("apply", *(a for name in files for a in ("-f", str(ROOT / name))), check=False)
            assert result.returncode == 0, f"kubectl apply -f {' -f '.join(files)}: {result.stderr}"
        finally:
            plane.stop()


def test_the_dashboard_and_rules_are_opt_in_and_ship_the_rendered_files():
    kinds = {d["kind"] for d in render_chart()}
    assert "PrometheusRule" not in kinds and "ConfigMap" not in kinds
    docs = render_chart("metrics.dashboard.enabled=true", "metrics.prometheusRule.enabled=true")
    (dashboard,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1", "the dashboard sidecar's label"
    assert dashboard["data"]["diloco.json"] == (CHART / "dashboards" / "diloco.json").read_text().rstrip("\n")
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert rule["spec"] == yaml.safe_load((CHART / "rules" / "diloco.yaml").read_text())
