#!/usr/bin/env bash
# node.sh KUBELET KUBE_PROXY NETPOL NETPOL_METRICS WORKDIR NODE_NAME API_SERVER GATEWAY IMAGE.tar...: containerd,
# kube-proxy, the NetworkPolicy controller (kube-network-policies, its metrics on NETPOL_METRICS), the kubelet of
# one real node and the pods' way to the API server. node.py runs it as the first process of its own PID and
# mount namespaces (unshare), so that stopping it leaves no process or mount behind: when the kubelet (PID 1
# there) exits, the kernel kills every shim, container, kube-proxy, the policy controller and the relay, and
# every mount made here (the private /run with containerd's sockets and the pods' netns files, container root
# filesystems) goes with the namespace. The network namespace is the host's: pods get their own, joined to it
# by the CNI bridge; the nftables tables of kube-proxy and the policy controller outlive it and node.py removes
# them.
set -euo pipefail
kubelet=$1 kube_proxy=$2 netpol=$3 netpol_metrics=$4 wd=$5 name=$6 api_server=$7 gateway=$8
shift 8
mount -t tmpfs tmpfs /run
# The kubelet and libcni write to these fixed paths: keep them inside this node's workdir.
mkdir -p /var/lib/cni /var/log/containers "$wd/cni-state" "$wd/container-logs"
mount --bind "$wd/cni-state" /var/lib/cni
mount --bind "$wd/container-logs" /var/log/containers

# The API server listens on the host's loopback only, which no pod can reach: relay the same port on the
# bridge's gateway address, where the `kubernetes` Service's endpoint points (node.py).
socat "TCP-LISTEN:${api_server##*:},bind=$gateway,reuseaddr,fork" "TCP:$api_server" >>"$wd/logs/relay.log" 2>&1 &
"$kube_proxy" --config "$wd/kube-proxy.yaml" >>"$wd/logs/kube-proxy.log" 2>&1 &
# kube-network-policies knows only the in-cluster configuration: its service account's token and CA where a
# pod has them (/var/run is /run, private here), and the API server's address in the environment.
account=/run/secrets/kubernetes.io/serviceaccount
mkdir -p "$account"
mount --bind "$wd/netpol-account" "$account"
KUBERNETES_SERVICE_HOST=${api_server%:*} KUBERNETES_SERVICE_PORT=${api_server##*:} \
    "$netpol" --hostname-override "$name" --metrics-bind-address "$netpol_metrics" --v 2 \
    >>"$wd/logs/kube-network-policies.log" 2>&1 &
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
