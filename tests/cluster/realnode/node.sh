#!/usr/bin/env bash
# node.sh KUBELET WORKDIR NODE_NAME IMAGE.tar...: containerd and the kubelet of one real node. node.py runs it as the first
# process of its own PID and mount namespaces (unshare), so that stopping it leaves nothing behind: when the
# kubelet (PID 1 there) exits, the kernel kills every shim and container, and every mount made here (the
# private /run with containerd's sockets and the pods' netns files, container root filesystems) goes with the
# namespace. The network namespace is the host's: pods get their own, joined to it by the CNI bridge.
set -euo pipefail
kubelet=$1 wd=$2 name=$3
shift 3
mount -t tmpfs tmpfs /run
# The kubelet and libcni write to these fixed paths: keep them inside this node's workdir.
mkdir -p /var/lib/cni /var/log/containers "$wd/cni-state" "$wd/container-logs"
mount --bind "$wd/cni-state" /var/lib/cni
mount --bind "$wd/container-logs" /var/log/containers

containerd --config "$wd/containerd.toml" >>"$wd/logs/containerd.log" 2>&1 &
ctr=(ctr --address /run/containerd/containerd.sock --namespace k8s.io)
for _ in $(seq 100); do
    "${ctr[@]}" version >/dev/null 2>&1 && break
    sleep 0.2
done
for image in "$@"; do
    "${ctr[@]}" images import "$image" >>"$wd/logs/images.log" 2>&1
done
exec "$kubelet" --config "$wd/kubelet.yaml" --kubeconfig "$wd/kubeconfig" \
    --hostname-override "$name" --node-ip 127.0.0.1 --v 2 >>"$wd/logs/kubelet.log" 2>&1
