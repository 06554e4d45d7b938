"""What the pod runner makes of a pod spec, as a kubelet would: environment, volumes, paths and /etc/hosts."""

from __future__ import annotations

import base64
import os

import pytest

from cluster.pod_runner import IMAGES, dockerfile_exec, image_name
from cluster.podspec import (
    Unresolvable,
    accelerators,
    container_command,
    expand,
    own_names,
    projected_files,
    render_hosts,
    resolve_env,
    rewrite_paths,
    secret_data,
    service_names,
)

POD = {
    "metadata": {"name": "job-a-0", "namespace": "ns", "uid": "u-1", "labels": {"apps.kubernetes.io/pod-index": "0"}},
    "spec": {"nodeName": "cpu-0", "hostname": "job-a-0", "subdomain": "job-a", "containers": []},
    "status": {"podIP": "10.244.3.7", "hostIP": "10.0.0.1"},
}
OBJECTS = {
    ("ConfigMap", "cfg"): {"training.json": "{}", "MODE": "diloco"},
    ("Secret", "tok"): {"token": "s3cret"},
}


def lookup(kind, name):
    return OBJECTS.get((kind, name))


def test_env_is_built_from_values_references_and_the_downward_api_in_kubelet_order():
    container = {
        "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CFG_"}],
        "env": [
            {"name": "CFG_MODE", "value": "override"},
            {
                "name": "RANK",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}},
            },
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "tok", "key": "token"}}},
            {"name": "GREETING", "value": "$(POD) at $(IP), $(UNSET) and $$(POD)"},
            {"name": "MAYBE", "valueFrom": {"configMapKeyRef": {"name": "gone", "key": "k", "optional": True}}},
        ],
    }
    env = resolve_env(POD, container, lookup)
    assert env == {
        "CFG_training.json": "{}",
        "CFG_MODE": "override",
        "RANK": "0",
        "POD": "job-a-0",
        "IP": "10.244.3.7",
        "TOKEN": "s3cret",
        "GREETING": "job-a-0 at 10.244.3.7, $(UNSET) and $(POD)",
    }


def test_a_missing_required_reference_is_a_config_error():
    container = {"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "tok", "key": "nope"}}}]}
    with pytest.raises(Unresolvable, match="Secret tok key nope"):
        resolve_env(POD, container, lookup)


def test_expand_leaves_unknown_references_alone():
    assert expand("$(A)-$(B)-$$", {"A": "1"}) == "1-$(B)-$"


def test_configmap_and_secret_volumes_become_files_and_paths_point_at_them():
    def files(volume):
        return projected_files(volume, POD, lookup, lambda source: f"jwt-for-{source.get('audience')}")

    assert files({"name": "c", "configMap": {"name": "cfg", "items": [{"key": "MODE", "path": "m/x"}]}}) == {
        "m/x": "diloco"
    }
    assert files({"name": "t", "secret": {"secretName": "tok"}}) == {"token": "s3cret"}
    assert files({"name": "e", "emptyDir": {}}) is None
    # What the ServiceAccount admission plugin adds to a pod that mounts its credentials:
    access = {
        "name": "kube-api-access",
        "projected": {
            "sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
                {"configMap": {"name": "cfg", "items": [{"key": "training.json", "path": "ca.crt"}]}},
                {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
            ]
        },
    }
    assert files(access) == {"token": "jwt-for-None", "ca.crt": "{}", "namespace": "ns"}
    mounts = {"/etc/diloco": "/w/config", "/etc": "/w/etc"}
    assert rewrite_paths("/etc/diloco/training.json", mounts) == "/w/config/training.json"
    assert rewrite_paths("/etc/dilocoX", mounts) == "/w/etc/dilocoX"
    assert rewrite_paths("/var/x", mounts) == "/var/x"


def test_hosts_resolve_services_and_headless_pods_to_their_pod_ips():
    slices = [
        {
            "metadata": {"namespace": "ns", "labels": {"kubernetes.io/service-name": "job-syncer-0"}},
            "addressType": "IPv4",
            "endpoints": [
                {"addresses": ["10.244.0.2"], "conditions": {"ready": True}},
                {"addresses": ["10.244.0.9"], "conditions": {"ready": False}},
            ],
        },
        {
            "metadata": {"namespace": "other", "labels": {"kubernetes.io/service-name": "job-a"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.244.1.3"], "hostname": "job-a-0", "conditions": {"ready": True}}],
        },
    ]
    entries = service_names(slices)
    hosts = render_hosts(entries, ("10.244.3.7", own_names(POD)), "ns").splitlines()
    assert "10.244.3.7\tjob-a-0.job-a.ns.svc.cluster.local job-a-0.job-a.ns.svc job-a-0" in hosts
    assert "10.244.0.2\tjob-syncer-0 job-syncer-0.ns job-syncer-0.ns.svc job-syncer-0.ns.svc.cluster.local" in hosts
    assert (
        "10.244.1.3\tjob-a.other job-a.other.svc job-a.other.svc.cluster.local job-a-0.job-a.other.svc "
        "job-a-0.job-a.other.svc.cluster.local"
    ) in hosts
    assert not any("10.244.0.9" in line for line in hosts), "a not-ready endpoint is not resolvable"


def test_command_and_args_replace_entrypoint_and_cmd_as_kubernetes_defines():
    assert container_command({"command": ["a"], "args": ["b"]}, ["ep"], ["cmd"]) == ["a", "b"]
    assert container_command({"command": ["a"]}, ["ep"], ["cmd"]) == ["a"]
    assert container_command({"args": ["--x"]}, ["ep"], ["cmd"]) == ["ep", "--x"]
    assert container_command({}, ["ep"], ["cmd"]) == ["ep", "cmd"]


def test_the_operator_image_runs_its_dockerfile_entrypoint():
    assert dockerfile_exec(IMAGES["diloco-operator"]) == (["diloco-operator"], [])


def test_images_match_by_repository_name_and_accelerator_pods_are_recognised():
    assert image_name("registry.example.com/team/diloco-trainer:1.0-cu126") == "diloco-trainer"
    assert image_name("diloco-trainer@sha256:abc") == "diloco-trainer"
    gpu = {"spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "8", "cpu": "1"}}}]}}
    assert accelerators(gpu) == 8
    assert accelerators({"spec": {"containers": [{"resources": {"requests": {"cpu": "1"}}}]}}) == 0
    two = {"resources": {"requests": {"nvidia.com/gpu": "2"}, "limits": {"nvidia.com/gpu": "2"}}}
    assert accelerators({"spec": {"containers": [two, two]}}) == 4, "per container, request and limit once"


def test_secret_data_is_decoded_to_the_bytes_it_holds():
    assert secret_data({"data": {"token": base64.b64encode(b"abc").decode()}}) == {"token": b"abc"}
    assert secret_data({"stringData": {"user": "me"}}) == {"user": b"me"}


def test_a_binary_secret_becomes_files_of_its_bytes_and_variables_that_start_as_them():
    """A keystore or a DER key is no text: its files hold the Secret's bytes, and a variable taken from it
    reaches the process as the same bytes (as a kubelet passes them)."""
    binary = bytes(range(256))
    data = secret_data({"data": {"keystore": base64.b64encode(binary).decode()}})

    def binary_lookup(kind, name):
        return data if (kind, name) == ("Secret", "store") else None

    files = projected_files({"name": "s", "secret": {"secretName": "store"}}, POD, binary_lookup, str)
    assert files == {"keystore": binary}
    env = resolve_env(
        POD,
        {"env": [{"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "store", "key": "keystore"}}}]},
        binary_lookup,
    )
    assert os.fsencode(env["KEY"]) == binary
