"""The test cluster's provisioner gives each pending claim a hostPath volume whose directory any user may
write, as kind's local-path-provisioner does: a non-root pod keeps its checkpoints there."""

import stat
from types import SimpleNamespace

from kubernetes import client

from cluster.volumes import PROVISIONED_BY, Provisioner


class FakeCore:
    """The CoreV1Api calls the provisioner makes: `claims` pending, no volume yet; records what it creates."""

    def __init__(self, claims):
        self.claims, self.created = claims, []

    def list_persistent_volume(self):
        return SimpleNamespace(items=[])

    def list_persistent_volume_claim_for_all_namespaces(self):
        return SimpleNamespace(items=self.claims)

    def create_persistent_volume(self, body):
        self.created.append(body)


def claim(name: str, uid: str) -> client.V1PersistentVolumeClaim:
    return client.V1PersistentVolumeClaim(
        metadata=client.V1ObjectMeta(name=name, namespace="readme", uid=uid),
        spec=client.V1PersistentVolumeClaimSpec(
            access_modes=["ReadWriteOnce"], resources=client.V1VolumeResourceRequirements(requests={"storage": "1Gi"})
        ),
    )


def test_a_pending_claim_gets_a_volume_whose_directory_any_user_may_write(tmp_path):
    provisioner = Provisioner(client.ApiClient(), tmp_path)
    provisioner.core = FakeCore([claim("tiny-cpu-syncer-0", "abc")])

    provisioner.pass_once()

    (volume,) = provisioner.core.created
    assert volume["metadata"] == {"name": "pvc-abc", "labels": {PROVISIONED_BY: "true"}}
    assert volume["spec"]["claimRef"]["name"] == "tiny-cpu-syncer-0"
    directory = tmp_path / "pvc-abc"
    assert volume["spec"]["hostPath"] == {"path": str(directory), "type": "DirectoryOrCreate"}
    assert stat.S_IMODE(directory.stat().st_mode) == 0o777
