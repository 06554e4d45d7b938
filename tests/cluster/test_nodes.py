"""Node pod CIDRs: a cluster started again on its own data reads back how many nodes it has made from the
CIDRs its nodes hold, so a node added later gets a CIDR no other node has."""

from __future__ import annotations

from cluster.nodes import cidr_index, pod_cidr


def test_a_pod_cidr_reads_back_as_the_index_it_was_made_for():
    assert [cidr_index(pod_cidr(i)) for i in (0, 1, 7, 255)] == [0, 1, 7, 255]
    assert pod_cidr(1) == "10.244.1.0/24"
