"""An island's environment is one contract between the operator, which renders it into an island's pods,
and `diloco run`, which gives it to each island's process on one machine (`diloco.pod_env`): the same
variables, meaning the same, so a loop that trains under `diloco run -- COMMAND` trains in a pod unchanged.

What a variable means is read back here as the island's process reads it: a file variable by the file it
names (on a cluster, the key of the ConfigMap or Secret mounted there), the pod's shape through
`PodShape.from_env`, the pod's own variables as the kubelet fills them for pod 0."""

from __future__ import annotations

import base64
import datetime
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from diloco import pod_env
from diloco.api.job import DiLoCoJobSpec
from diloco.core.config import TrainingConfig
from diloco.lifetime import LAUNCHER_PID
from diloco.local.launcher import GRACE_SECONDS, TOKEN, LocalJob, RunPlan
from diloco.operator import naming as n
from diloco.operator.children import OperatorRef, Scale, child_key, render_children, tls_secret
from diloco.operator.job_tls import CA_FILE, job_tls, operator_made_data, server_names
from diloco.operator.tokens import JobTokens, ca_key
from diloco.worker.pod_ranks import LOOPBACK, PodShape

JOB = n.JobRef(name="demo", namespace="ml", uid="0b7c6c1e-uid")
NOW = datetime.datetime(2026, 11, 24, tzinfo=datetime.UTC)
OPERATOR_TOKEN = "s3cret"
ISLAND = "island-0"
SHARDS = 2
RANKS = [1, 2]


def spec_of(ranks: int) -> DiLoCoJobSpec:
    """A job whose one island runs a command of one's own, as `diloco run --ranks-per-island <ranks> --
    COMMAND` runs each island: one pod of `ranks` ranks, a CPU each, checkpointing every 10 steps."""
    return DiLoCoJobSpec.model_validate(
        {
            "image": "reg.example/diloco:1",
            "trainer": {"command": ["python", "train.py"]},
            "training": {"innerSteps": 20, "fragments": 2, "overlapSteps": 2},
            "islands": [
                {
                    "name": ISLAND,
                    "replicas": 1,
                    "acceleratorsPerPod": ranks,
                    "resources": {"limits": {"cpu": str(ranks)}},
                    "checkpoint": {"size": "1Gi", "checkpointEvery": 10},
                }
            ],
            "syncer": {"shards": SHARDS},
        }
    )


Understood = dict[str, Any]


def understood(env: Mapping[str, str], read: Callable[[str], bytes], token: str, ca: bytes) -> Understood:
    """What an island's process makes of its environment, variable by variable: `read` gives the bytes of a
    file the environment names; `token` and `ca` are the job's."""
    shape = PodShape.from_env(env)
    meaning: Understood = {
        pod_env.JOB: bool(env[pod_env.JOB]),
        pod_env.ISLAND: env[pod_env.ISLAND],
        pod_env.SYNCERS: len(env[pod_env.SYNCERS].split(",")),
        pod_env.CONFIG_FILE: TrainingConfig.from_json(read(env[pod_env.CONFIG_FILE]).decode()),
        pod_env.TOKEN_FILE: read(env[pod_env.TOKEN_FILE]).decode().strip() == token,
        pod_env.TLS_CA_FILE: read(env[pod_env.TLS_CA_FILE]) == ca,
        pod_env.METRICS_PORT: int(env[pod_env.METRICS_PORT]) > 0,
        pod_env.ACCELERATORS_PER_POD: shape.ranks_per_pod,
        pod_env.WORLD_SIZE: shape.world_size,
        pod_env.NODE_RANK: shape.node_rank,
        pod_env.CHECKPOINT_DIR: Path(env[pod_env.CHECKPOINT_DIR]).is_absolute(),
        pod_env.CHECKPOINT_EVERY: int(env[pod_env.CHECKPOINT_EVERY]),
        pod_env.THREADS: int(env[pod_env.THREADS]),
        pod_env.MASTER_ADDR: shape.rendezvous_host(env[pod_env.MASTER_ADDR]),
        pod_env.MASTER_PORT: int(env[pod_env.MASTER_PORT]) > 0,
        pod_env.POD_NAME: env[pod_env.POD_NAME].endswith("-0"),
    }
    if pod_env.RANK in env:
        meaning[pod_env.RANK] = shape.global_rank(0) == int(env[pod_env.RANK])
    return meaning


def operator_pod(ranks: int) -> tuple[dict[str, Any], Callable[[str], bytes], dict[str, Any]]:
    """The island's rendered pod 0: its environment as the kubelet fills it (ordinal 0), a reader of the
    files its volumes hold, and its pod spec."""
    spec = spec_of(ranks)
    key = ca_key(b"k" * 32, JOB)
    live = tls_secret(JOB, operator_made_data(JOB, {}, server_names(JOB, SHARDS), NOW, key))
    tls = job_tls(JOB, spec, live, {}, NOW, ca_key=key)
    scale = Scale(islands={ISLAND: 1}, syncers=1)
    children = {
        child_key(c): c
        for c in render_children(JOB, spec, JobTokens.only(OPERATOR_TOKEN), scale, OperatorRef("ops"), tls=tls)
    }
    statefulset = children["StatefulSet", n.island_name(JOB.name, ISLAND)]
    pod = statefulset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    fields = {f"metadata.labels['{n.POD_INDEX_LABEL}']": "0", "metadata.name": f"{statefulset['metadata']['name']}-0"}
    env = {e["name"]: e.get("value") or fields[e["valueFrom"]["fieldRef"]["fieldPath"]] for e in container["env"]}

    def object_data(kind: str, name: str, key: str) -> bytes:
        held = children[kind, name]["data"][key]
        return base64.b64decode(held) if kind == "Secret" else held.encode()

    def read(path: str) -> bytes:
        (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        key = path.removeprefix(mount["mountPath"] + "/")
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        if "configMap" in volume:
            return object_data("ConfigMap", volume["configMap"]["name"], key)
        if "secret" in volume:
            return object_data("Secret", volume["secret"]["secretName"], key)
        (found,) = [
            (source["secret"]["name"], item["key"])
            for source in volume["projected"]["sources"]
            for item in source["secret"]["items"]
            if item["path"] == key
        ]
        return object_data("Secret", *found)

    return env, read, pod


def local_island(tmp_path: Path, ranks: int) -> LocalJob:
    plan = RunPlan(
        mode="diloco",
        config=spec_of(ranks).training,
        out=tmp_path,
        islands=1,
        ranks_per_island=ranks,
        shards=SHARDS,
        checkpoint_every=10,
        command=("python", "train.py"),
    )
    return LocalJob(plan)


@pytest.mark.parametrize("ranks", RANKS)
def test_a_command_gets_the_variables_an_island_pod_gets(tmp_path, ranks):
    rendered, _, _ = operator_pod(ranks)
    job = local_island(tmp_path, ranks)
    assert set(job.island_env(0)) == set(rendered)
    assert (pod_env.RANK in rendered) == (ranks == 1), "a pod of several ranks has no one rank"
    process = job.workers[ISLAND].env
    assert process.items() >= job.island_env(0).items(), "the island's process gets every one of them"
    beyond = set(process) - set(rendered) - set(os.environ)
    plumbing = {"MKL_NUM_THREADS", "PYTHONUNBUFFERED", "DILOCO_LOG_LEVEL", LAUNCHER_PID}  # any process of the run's
    instruments = pod_env.LOCAL_RUN - {pod_env.REFERENCE_STEP_SECONDS}  # a reference step only when emulated
    assert beyond - plumbing == instruments - set(os.environ), "beyond a pod's variables: the run's instruments"


@pytest.mark.parametrize("ranks", RANKS)
def test_each_variable_means_the_same_to_the_process_in_a_pod_and_on_one_machine(tmp_path, ranks):
    rendered, read_in_pod, pod = operator_pod(ranks)
    job = local_island(tmp_path, ranks)
    local = job.island_env(0)
    operator_ca = read_in_pod(rendered[pod_env.TLS_CA_FILE])
    in_pod = understood(rendered, read_in_pod, OPERATOR_TOKEN, operator_ca)
    here = understood(local, lambda path: Path(path).read_bytes(), TOKEN, job.pki.ca.cert)
    assert here == in_pod
    assert in_pod[pod_env.TOKEN_FILE] and in_pod[pod_env.TLS_CA_FILE], "the job's token and CA, both sides"
    assert in_pod[pod_env.MASTER_ADDR] == LOOPBACK, "a one-pod island's ranks meet on loopback, both sides"
    assert operator_ca.startswith(b"-----BEGIN CERTIFICATE-----") and CA_FILE in rendered[pod_env.TLS_CA_FILE]
    # The grace period is what each side really gives the process between SIGTERM and SIGKILL.
    assert int(rendered[pod_env.TERMINATION_GRACE_SECONDS]) == pod["terminationGracePeriodSeconds"]
    assert int(local[pod_env.TERMINATION_GRACE_SECONDS]) == GRACE_SECONDS
    # The checkpoint folder is the island's checkpoint volume in a pod, a folder of the run's here.
    assert {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}[
        rendered[pod_env.CHECKPOINT_DIR]
    ] == "checkpoints"
    assert Path(local[pod_env.CHECKPOINT_DIR]).is_relative_to(tmp_path)
