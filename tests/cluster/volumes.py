"""A local-path volume provisioner: the test cluster's storage. Every PersistentVolumeClaim that is pending gets
a hostPath PersistentVolume of its size, pre-bound to it (kube-controller-manager's binder then binds the
pair, as with any provisioner); a volume released by a deleted claim is deleted with its directory. Without
it the scheduler would never place a pod that mounts a claim, as on a cluster with no storage.

As kind's local-path-provisioner does, it makes each volume's directory itself, writable by every user: a
pod's non-root user (the syncer's uid 10001) must write its checkpoints there, and neither fsGroup nor the
kubelet (which would make a missing hostPath directory root's, mode 0755) does that for a hostPath volume.
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("tests.cluster.volumes")

PROVISIONED_BY = "diloco.dev/test-provisioner"
VOLUME_MODE = 0o777
"""A new volume's directory mode, local-path-provisioner's (`mkdir -m 0777`)."""


def volume_for(claim: dict[str, Any], root: Path) -> dict[str, Any]:
    """The PersistentVolume that satisfies `claim` (an API object as a dict), its data under `root`."""
    meta, spec = claim["metadata"], claim["spec"]
    name = f"pvc-{meta['uid']}"
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name, "labels": {PROVISIONED_BY: "true"}},
        "spec": {
            "capacity": {"storage": spec["resources"]["requests"]["storage"]},
            "accessModes": spec["accessModes"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": spec.get("storageClassName") or "",
            "hostPath": {"path": str(root / name), "type": "DirectoryOrCreate"},
            "claimRef": {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "namespace": meta["namespace"],
                "name": meta["name"],
                "uid": meta["uid"],
            },
        },
    }


class Provisioner:
    """Polls claims and volumes once per `interval` seconds in a daemon thread until `stop`."""

    def __init__(self, api: client.ApiClient, root: Path, interval: float = 0.5) -> None:
        self.core = client.CoreV1Api(api)
        self.api = api
        self.root = root
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="volume-provisioner", daemon=True)

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.pass_once()
            except (ApiException, OSError) as error:
                log.debug("provisioner pass failed: %s", error)

    def pass_once(self) -> None:
        volumes = {v.metadata.name: v for v in self.core.list_persistent_volume().items}
        for claim in self.core.list_persistent_volume_claim_for_all_namespaces().items:
            if claim.spec.volume_name or f"pvc-{claim.metadata.uid}" in volumes:
                continue
            body = volume_for(self.api.sanitize_for_serialization(claim), self.root)
            directory = self.root / body["metadata"]["name"]
            directory.mkdir(exist_ok=True)
            directory.chmod(VOLUME_MODE)  # mkdir's mode is cut by the umask
            self.core.create_persistent_volume(body)
        for name, volume in volumes.items():
            if (volume.metadata.labels or {}).get(PROVISIONED_BY) and volume.status.phase == "Released":
                self.core.delete_persistent_volume(name)
                shutil.rmtree(self.root / name, ignore_errors=True)
