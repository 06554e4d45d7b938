#!/usr/bin/env bash
# node.sh KUBELET KUBE_PROXY NETPOL WORKDIR NETPOL_ACCOUNT NODE_NAME NODE_IP NODE_LABELS API_SERVICE:
# containerd, kube-proxy, the NetworkPolicy controller (kube-network-policies) and the kubelet of one real node.
# node.py runs it in the node's network namespace, as the first process of its own PID and mount namespaces
# (unshare), so that stopping it leaves no process or mount behind: when the kubelet (PID 1 there) exits, the
# kernel kills every shim, container, kube-proxy and the policy controller, and every mount made here (the private
# /run with containerd's sockets and the pods' netns files, container root filesystems, the kubelet's and CNI's
# folders) goes with the namespace. Pods get network namespaces of their own, joined to the node's by the CNI
# bridge; the node's nftables tables (kube-proxy's, the policy controller's) go with its network namespace.
set -euo pipefail
kubelet=$1 kube_proxy=$2 netpol=$3 wd=$4 netpol_account=$5 name=$6 node_ip=$7 labels=$8 api_service=$9
mount -t tmpfs tmpfs /run
# The kubelet and libcni write to these fixed paths: keep them inside this node's workdir, apart from the other
# nodes' on this host.
mkdir -p /var/lib/kubelet /var/lib/cni /var/log/containers "$wd/cni-state" "$wd/container-logs"
mount --bind "$wd/kubelet" /var/lib/kubelet
mount --bind "$wd/cni-state" /var/lib/cni
mount --bind "$wd/container-logs" /var/log/containers

"$kube_proxy" --config "$wd/kube-proxy.yaml" >>"$wd/logs/kube-proxy.log" 2>&1 &
# kube-network-policies knows only the in-cluster configuration: its service account's token and CA where a
# pod has them (/var/run is /run, private here), and the `kubernetes` Service's address in the environment (as
# in a pod; kube-proxy, beside it, routes it to the API server).
account=/run/secrets/kubernetes.io/serviceaccount
mkdir -p "$account"
mount --bind "$netpol_account" "$account"
KUBERNETES_SERVICE_HOST=${api_service%:*} KUBERNETES_SERVICE_PORT=${api_service##*:} \
    "$netpol" --hostname-override "$name" --metrics-bind-address 127.0.0.1:9080 --v 2 \
    >>"$wd/logs/kube-network-policies.log" 2>&1 &
# Its store holds the node's images already (node.py). The kubelet gives up on a runtime that is not there yet.
containerd --config "$wd/containerd.toml" >>"$wd/logs/containerd.log" 2>&1 &
for _ in $(seq 100); do
    ctr --address /run/containerd/containerd.sock version >/dev/null 2>&1 && break
    sleep 0.2
done
exec "$kubelet" --config "$wd/kubelet.yaml" --kubeconfig "$wd/kubeconfig" \
    --hostname-override "$name" --node-ip "$node_ip" --node-labels "$labels" --v 2 >>"$wd/logs/kubelet.log" 2>&1
