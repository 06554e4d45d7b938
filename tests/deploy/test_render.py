"""The generated CRDs: committed copies are fresh, the schema is structural, and the CEL rules mirror the
model's own validation."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kubernetes.client import models as k8s

from diloco.api import job as model
from diloco.api.job import DiLoCoJob
from diloco.core.config import TrainingConfig

ROOT = Path(__file__).resolve().parents[2]
_loader = importlib.util.spec_from_file_location("render", ROOT / "deploy" / "render.py")
render = importlib.util.module_from_spec(_loader)
_loader.loader.exec_module(render)

ALLOWED_KEYS = {
    "type",
    "description",
    "default",
    "enum",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "maxProperties",
    "multipleOf",
    "items",
    "properties",
    "additionalProperties",
    "required",
    "anyOf",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-int-or-string",
    "x-kubernetes-validations",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
}
TYPES = {"object", "array", "string", "integer", "number", "boolean"}


def schema() -> dict:
    return render.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def walk(node: dict, path: str = "$"):
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


def conforms(value, node: dict) -> bool:
    """A small validator for defaults: type, enum, bounds, properties."""
    if node.get("x-kubernetes-int-or-string"):
        return isinstance(value, int) or (isinstance(value, str) and re.match(node["pattern"], value))
    kind = node["type"]
    checks = {"object": dict, "array": list, "string": str, "boolean": bool, "integer": int, "number": (int, float)}
    if not isinstance(value, checks[kind]) or (kind in ("integer", "number") and isinstance(value, bool)):
        return False
    if "enum" in node and value not in node["enum"]:
        return False
    if "minimum" in node and (value < node["minimum"] or (node.get("exclusiveMinimum") and value == node["minimum"])):
        return False
    if "maximum" in node and (value > node["maximum"] or (node.get("exclusiveMaximum") and value == node["maximum"])):
        return False
    if kind == "object":
        return all(conforms(v, node["properties"][k]) for k, v in value.items() if k in node.get("properties", {}))
    return True


def test_committed_files_are_fresh():
    result = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "render.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert render.stale() == []


def test_check_names_a_stale_file(tmp_path, monkeypatch, capsys):
    stale_copy = tmp_path / "crd.yaml"
    stale_copy.write_text("old\n")
    monkeypatch.setattr(render, "ROOT", tmp_path)
    monkeypatch.setattr(render, "outputs", lambda: {stale_copy: "new\n", tmp_path / "missing.yaml": "x\n"})
    assert render.stale() == [stale_copy, tmp_path / "missing.yaml"]
    assert render.main(["--check"]) == 1
    assert "stale: crd.yaml" in capsys.readouterr().err


def test_chart_copy_is_the_same_crd():
    deploy = (ROOT / "deploy" / "crd.yaml").read_text()
    assert (ROOT / "charts" / "diloco" / "crds" / "dilocojobs.diloco.dev.yaml").read_text() == deploy
    assert yaml.safe_load(deploy) == render.crd()


def test_crd_envelope():
    crd = render.crd()
    assert crd["metadata"]["name"] == "dilocojobs.diloco.dev"
    names = crd["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == ("DiLoCoJob", "dilocojobs", ["dj"])
    version = crd["spec"]["versions"][0]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {
        "Phase": ".status.phase",
        "Islands": ".status.islandsReady",
        "Outer Step": ".status.outerStep",
        "Tokens": ".status.tokens",
        "Goodput": ".status.goodput",
        "Loss": ".status.loss",
        "Syncers": ".status.syncer.ready",
        "Age": ".metadata.creationTimestamp",
    }
    status_props = schema()["properties"]["status"]["properties"]
    for path in columns.values():
        head, *rest = path.split(".")[1:]
        if head == "status":
            assert rest[0] in status_props, path


def test_the_kubernetes_models_accept_the_crd():
    crd = k8s.V1CustomResourceDefinition.from_dict(render.crd())
    props = crd.spec.versions[0].var_schema.open_apiv3_schema.properties
    assert props["spec"].properties["islands"].x_kubernetes_list_type == "map"
    assert props["spec"].properties["islands"].x_kubernetes_list_map_keys == ["name"]


def test_schema_is_structural():
    for path, node in walk(schema()):
        assert set(node) <= ALLOWED_KEYS, (path, set(node) - ALLOWED_KEYS)
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
            assert "type" not in node, path
            continue
        assert "anyOf" not in node, path
        assert node.get("type") in TYPES, path
        assert not ("properties" in node and "additionalProperties" in node), path
        assert node.get("additionalProperties") is not False, path
        if node.get("x-kubernetes-preserve-unknown-fields"):
            assert node["type"] == "object" and "properties" not in node, path
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            assert node.get(bound, True) is True, (path, bound)
        for required in node.get("required", []):
            assert required in node["properties"], (path, required)
        if node.get("x-kubernetes-list-type") == "map":
            item = node["items"]
            for key in node["x-kubernetes-list-map-keys"]:
                assert key in item.get("required", []) or "default" in item["properties"][key], (path, key)
        if "default" in node:
            assert conforms(node["default"], node), (path, node["default"])
    assert schema()["properties"]["metadata"] == {"type": "object", "properties": {"name": {"type": "string"}}}


def test_spec_defaults_reach_every_nested_setting():
    spec_schema = schema()["properties"]["spec"]
    for name in ("trainer", "training", "syncer", "failurePolicy", "stopCondition"):
        node = spec_schema["properties"][name]
        with_defaults = {k for k, v in node["properties"].items() if "default" in v}
        assert set(node["default"]) == with_defaults, name
    training = spec_schema["properties"]["training"]
    # A setting unset by default (None) has no default in the CRD: null is never a value there.
    assert training["default"] == TrainingConfig().model_dump(mode="json", by_alias=True, exclude_none=True)
    assert spec_schema["properties"]["syncer"]["default"]["checkpoint"] == {"size": "1Gi", "intervalSeconds": 30.0}
    island = spec_schema["properties"]["islands"]["items"]["properties"]
    assert island["acceleratorResource"]["default"] == "nvidia.com/gpu"
    # The pod-template override is an allowlist: a structural schema, not free-form.
    assert "x-kubernetes-preserve-unknown-fields" not in island["podTemplate"]
    assert set(island["podTemplate"]["properties"]["spec"]["properties"]) == {
        "nodeSelector",
        "tolerations",
        "affinity",
        "topologySpreadConstraints",
        "priorityClassName",
        "terminationGracePeriodSeconds",
        "imagePullSecrets",
        "containers",
        "volumes",
    }
    assert island["resources"]["properties"]["limits"]["additionalProperties"]["x-kubernetes-int-or-string"] is True
    assert "default" not in schema()["properties"]["status"]["properties"]["phase"]


def test_bounds_survive_the_conversion():
    props = schema()["properties"]["spec"]["properties"]
    assert props["islands"]["minItems"] == 1 and props["islands"]["maxItems"] == model.MAX_ISLANDS
    island = props["islands"]["items"]["properties"]
    assert island["name"]["pattern"] == model.DNS_LABEL and island["name"]["maxLength"] == model.ISLAND_NAME_MAX
    assert island["replicas"]["minimum"] == 1
    decay = props["training"]["properties"]["stalenessDecay"]
    assert (decay["minimum"], decay["exclusiveMinimum"], decay["maximum"]) == (0, True, 1)


def rules(node: dict) -> dict[str, str]:
    return {r["rule"]: r["message"] for r in node.get("x-kubernetes-validations", [])}


def test_cel_rules_span_fields_and_name_them():
    spec_rules = rules(schema()["properties"]["spec"])
    expected = {
        "self.training.quorum <= size(self.islands)": "spec.training.quorum",
        "self.training.fragments <= self.training.innerSteps": "spec.training.fragments",
        "self.syncer.shards <= self.training.fragments": "spec.syncer.shards",
        "self.training.fragments == oldSelf.training.fragments": "spec.training.fragments is immutable",
        "self.syncer.shards == oldSelf.syncer.shards": "spec.syncer.shards is immutable",
    }
    for rule, named in expected.items():
        assert named in spec_rules[rule], rule
    overlap = [m for r, m in spec_rules.items() if "overlapSteps <" in r]
    assert overlap and "spec.training.overlapSteps" in overlap[0]
    trainer = rules(schema()["properties"]["spec"]["properties"]["trainer"])
    assert any("spec.trainer.command" in m for m in trainer.values())
    island = rules(schema()["properties"]["spec"]["properties"]["islands"]["items"])
    assert any("spec.islands[].name" in m for m in island.values())
    root = rules(schema())
    assert any("metadata.name" in m for m in root.values())
    for path, node in walk(schema()):
        for entry in node.get("x-kubernetes-validations", []):
            assert entry["message"].split()[0].startswith(("spec.", "metadata.")), (path, entry)


def test_peering_crds_are_kopfs():
    kinds = {c["spec"]["names"]["kind"]: c["spec"]["scope"] for c in render.peering_crds()}
    assert kinds == {"ClusterKopfPeering": "Cluster", "KopfPeering": "Namespaced"}
    for crd in render.peering_crds():
        assert crd["spec"]["group"] == "kopf.dev"
        k8s.V1CustomResourceDefinition.from_dict(crd)


EXAMPLE_JOBS = [*sorted((ROOT / "deploy" / "examples").glob("*.yaml")), ROOT / "examples" / "custom_loop" / "job.yaml"]


@pytest.mark.parametrize("path", EXAMPLE_JOBS, ids=lambda p: p.name)
def test_examples_are_valid_jobs(path):
    job = DiLoCoJob.model_validate(yaml.safe_load(path.read_text()))
    assert job.spec.islands
